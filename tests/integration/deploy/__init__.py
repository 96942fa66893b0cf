"""The deploy recipes' launcher (deploy/bare-metal/rpcps-node.sh) on one host and across hosts in network
namespaces."""
