"""The two opsets every function here is written against: standard ONNX (`ai.onnx`, OPSET) for the
bodies, and the `glm5` custom domain that names the functions themselves."""

from typing import TypeVar, Union

from onnxscript import BFLOAT16, FLOAT, FLOAT16
from onnxscript import opset18 as op
from onnxscript.values import Opset

OPSET = 18
DOMAIN = "glm5"
DOMAIN_VERSION = 1

glm5 = Opset(DOMAIN, DOMAIN_VERSION)

# TensorProto element types for Cast(to=...): onnxscript reads module-level ints as attribute values
F32, I8, I32, I64, BOOL, F64 = 1, 3, 6, 7, 9, 11

#: a floating input's dtype, carried to outputs "of the dtype of x" (return annotations: exporters read
#: the number and types of a function's outputs from them)
TFloat = TypeVar("TFloat", bound=Union[FLOAT, FLOAT16, BFLOAT16])  # noqa: UP007 (onnxscript reads Union)
#: an output whose dtype is chosen by an `out_dtype` attribute
TOut = TypeVar("TOut", bound=Union[FLOAT, FLOAT16, BFLOAT16])  # noqa: UP007

__all__ = [
    "BOOL",
    "DOMAIN",
    "DOMAIN_VERSION",
    "F32",
    "F64",
    "I8",
    "I32",
    "I64",
    "OPSET",
    "TFloat",
    "TOut",
    "glm5",
    "op",
]
