import os

# Triton kernels run on CPU only through the interpreter, and only if this is set
# before triton is first imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
