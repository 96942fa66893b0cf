"""What workers compute against real servers: asynchronous training, local steps, a training loop of the user's
own, equivalence with one process, compressed pushes, the GPU."""
