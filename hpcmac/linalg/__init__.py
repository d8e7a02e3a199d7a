"""hpcmac.linalg."""
