"""The parameter server: the one true copy of the parameters and the one optimizer state."""
