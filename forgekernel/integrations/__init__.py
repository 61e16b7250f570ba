"""Integrations with other libraries, each its own module, imported on demand (none of them is
imported by `import forgekernel`, so the library they serve stays optional):

    forgekernel.integrations.transformers   `attn_implementation="forgekernel"` for Hugging Face
                                            transformers models (importing it registers it)
"""
