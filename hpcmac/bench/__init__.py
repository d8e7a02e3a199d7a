"""hpcmac.bench."""
