import os

# torch_npu (or any other out-of-tree backend) must never be auto-imported in tests.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
