"""Torch implementations of the registered architectures, one file each.

A declaration in runtime/models names its implementation here as "module:Class";
parameter names equal the HF checkpoint's, so loading needs no renaming table.
"""
