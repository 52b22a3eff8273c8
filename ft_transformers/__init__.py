"""ft_transformers: fault-tolerant transformer inference for Hugging Face Transformers.

Importing the package registers the ``"efta"`` attention implementation (and its mask
function) with transformers::

    import ft_transformers as ftt
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="efta")
    model = ftt.enable_fault_tolerance(model, ftt.FTConfig())
    out = model.generate(**inputs)
    print(ftt.fault_report(model))
"""

from . import pasa
from .attention import register as _register
from .checked_linear import checked_linear
from .config import FTConfig, UncorrectableFaultError
from .efta import efta_attention
from .events import FaultEvent, FTReport
from .injection import FaultSpec
from .patches import register_family
from .protect import disable_fault_tolerance, enable_fault_tolerance, fault_report, inject_faults
from .vabft import vabft_threshold

__version__ = "0.1.0"  # the package version's one source: pyproject.toml reads it (dynamic)

__all__ = [
    "FTConfig",
    "FTReport",
    "FaultEvent",
    "FaultSpec",
    "UncorrectableFaultError",
    "checked_linear",
    "disable_fault_tolerance",
    "efta_attention",
    "enable_fault_tolerance",
    "fault_report",
    "inject_faults",
    "pasa",
    "register_family",
    "vabft_threshold",
]

_register()
