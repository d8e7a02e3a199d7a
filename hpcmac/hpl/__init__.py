"""hpcmac.hpl."""
