"""The attention forms of the exported Llama, one file each: how a decoder layer keeps its K/V cache and attends
over it, and what one call makes once for every layer (its start position, mask and rope). A form registers
itself under the name a backend asks for (ExportOptions.attention, and whether the cache is a ring); the module
picks its form once, when it is built (form_for). A new form is a new file here."""
from __future__ import annotations

import importlib
import pkgutil

from models.attention.base import FORMS, AttentionForm
from models.module_options import KV_CACHE_DTYPES, ExportOptions


def attention_forms() -> dict[tuple[str, bool], type[AttentionForm]]:
    """Every form in this folder, by (name, takes a ring)."""
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
    return FORMS


def form_for(options: ExportOptions) -> type[AttentionForm]:
    forms = attention_forms()
    names = tuple(dict.fromkeys(name for name, _ring in forms))
    if options.attention not in names:
        raise ValueError(f"attention must be one of {names}, got {options.attention!r}")
    if options.kv_cache_dtype is not None and options.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {tuple(KV_CACHE_DTYPES)}, got {options.kv_cache_dtype!r}")
    if options.kv_window is not None and options.kv_window < 1:
        raise ValueError(f"kv_window must be at least 1, got {options.kv_window}")
    form = forms.get((options.attention, bool(options.kv_window)))
    if form is None or (options.cache_storage != options.dtype and not form.stores_cache_apart):
        ring_forms = [name for name, ring in forms if ring]
        raise ValueError(f"attention={options.attention!r} keeps its caches whole and in the module's dtype; "
                         f"a ring or another cache dtype needs attention={ring_forms[0]!r}")
    return form
