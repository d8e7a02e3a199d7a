"""HPL-MxP: mixed-precision LINPACK (low-precision LU, FP64 GMRES refinement)."""
