"""hpcmac.io."""
