"""hpcmac.launch."""
