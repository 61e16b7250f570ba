"""fp32 PyTorch references: the specification every kernel is checked against."""
