"""The dtype codes of the safetensors format and the check of a shape read from a file, without torch: a process
that only reads manifests and layouts (a manager, a store, the CLI) must not import torch for them
(``safetensors_io`` maps the codes to torch dtypes and re-exports these names)."""

NUMPY_TO_CODE = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "uint16": "U16",
    "uint32": "U32",
    "uint64": "U64",
    "complex64": "C64",
}
CODE_TO_NUMPY = {v: k for k, v in NUMPY_TO_CODE.items()}
ITEMSIZE = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "U16": 2,
    "U32": 4,
    "U64": 8,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "C64": 8,
}

MAX_NUMEL = 2**63 - 1  # torch's element count is an int64


def check_shape(shape) -> str | None:
    """What is wrong with a shape read from a file (None if nothing): it must be a list of at most 64
    non-negative integers whose product (zero dimensions aside) fits torch's int64 element count, else
    ``torch.empty`` raises a raw TypeError/RuntimeError instead of a CheckpointError."""
    if not isinstance(shape, list) or len(shape) > 64:
        return "shape must be a list of at most 64 non-negative integers"
    numel = 1
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or not 0 <= d <= MAX_NUMEL:
            return "shape must be a list of non-negative integers below 2**63"
        numel *= max(d, 1)
        if numel > MAX_NUMEL:
            return f"shape {shape} holds more than 2**63 elements"
    return None
