"""Which quantization scheme each backend takes on this stack (torch 2.13, executorch 1.4.1, torchao 0.18).
Recipes are named `<backend>-<scheme>`; a combination outside this table is refused before any work."""
from __future__ import annotations

from errors import UserFacingError

# backend -> schemes (names in quant.schemes.SCHEMES) it lowers correctly
BACKEND_SCHEMES: dict[str, tuple[str, ...]] = {
    "xnnpack": ("fp32", "fp16", "8da4w", "8da4w-emb4", "8da8w"),
    # fp16 on Core ML is a compute precision of the fp32 scheme (recipe coreml-fp16), not a cast.
    "coreml": ("fp32", "int4-weight", "int8-weight"),
    "qnn": ("qnn-16a4w", "qnn-16a8w", "qnn-8a8w"),
}

# Why a combination someone would expect is not in the table (checked on a tiny Llama).
REFUSED: dict[tuple[str, str], str] = {
    ("xnnpack", "int8-weight"): "XNNPACK does not take weight-only linears: the .pte keeps fp32 weights and "
    "its logits are wrong; use 8da8w (int8 weights, int8 dynamic activations)",
    ("xnnpack", "int4-weight"): "XNNPACK does not take weight-only linears: the .pte keeps fp32 weights and "
    "its logits are wrong; use 8da4w (int4 weights, int8 dynamic activations)",
    ("xnnpack", "bf16"): "not offered: XNNPACK's bf16 support is not checked on this stack; use fp16",
    ("coreml", "fp16"): "use the coreml-fp16 recipe: Core ML casts to fp16 itself (compute precision)",
    ("coreml", "8da4w"): "Core ML has no dynamic activation quantization; use int4-weight",
}


def accepted_schemes(backend: str) -> tuple[str, ...]:
    return BACKEND_SCHEMES.get(backend, ())


def check_scheme(backend: str, scheme: str) -> None:
    if scheme in accepted_schemes(backend):
        return
    if backend not in BACKEND_SCHEMES:
        raise UserFacingError(f"unknown backend {backend!r}; choose one of: {', '.join(BACKEND_SCHEMES)}.")
    why = REFUSED.get((backend, scheme))
    raise UserFacingError(
        f"{backend} does not take the {scheme} scheme" + (f" ({why})" if why else "")
        + f"; {backend} takes: {', '.join(accepted_schemes(backend))}."
    )


def check_recipe_name(name: str, registered: dict) -> None:
    """A name that is not a registered recipe but reads as `<backend>-<known scheme>` is refused with
    the schemes that backend takes, rather than as an unknown name."""
    from quant.schemes import SCHEMES

    if name in registered:
        return
    for backend in BACKEND_SCHEMES:
        scheme = name[len(backend) + 1:] if name.startswith(backend + "-") else None
        if scheme in SCHEMES or (backend, scheme) in REFUSED:
            check_scheme(backend, scheme)
            recipes = sorted(r.name for r in registered.values() if r.backend == backend)
            raise UserFacingError(f"unknown recipe {name!r}; {backend} recipes: {', '.join(recipes)}.")


def compatibility_table() -> str:
    """Backend x scheme grid for `python -m recipes list`: `yes`, or `-` with the reason below."""
    from quant.schemes import SCHEMES

    schemes = list(SCHEMES)
    width = max(len(s) for s in schemes) + 2
    lines = [(f"{'scheme':<{width}}" + "".join(f"{b:<9}" for b in BACKEND_SCHEMES)).rstrip()]
    for scheme in schemes:
        cells = "".join(f"{'yes' if scheme in accepted_schemes(b) else '-':<9}" for b in BACKEND_SCHEMES)
        lines.append(f"{scheme:<{width}}{cells}".rstrip())
    lines += [f"  {backend} + {scheme}: {why}" for (backend, scheme), why in REFUSED.items()]
    return "\n".join(lines)
