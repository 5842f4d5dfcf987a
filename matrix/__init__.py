"""The support matrix: docs tables generated from the model declarations, and their checks.

`tandem matrix render` writes every generated region of the docs, `tandem matrix check`
reports stale regions and non-canonical glyphs, and `matrix/mkdocs_hook.py` re-renders
the same regions when the site is built. Nothing here imports torch.
"""
