"""The worker: computes gradients on its own data shard and pushes them to the server asynchronously."""
