"""hpcmac.llm."""
