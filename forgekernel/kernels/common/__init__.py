"""Pieces shared by the kernel leaves, one folder per architecture (`sm90/`)."""
