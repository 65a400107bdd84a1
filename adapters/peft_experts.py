"""LoRA on a mixture of experts: PEFT adapters of the fused expert weights and of the router.

transformers 5 stores an MoE layer's experts fused, ``mlp.experts.gate_up_proj [E, 2I, H]`` and
``mlp.experts.down_proj [E, H, I]`` (``[experts, out, in]``), and its router as ``mlp.gate.weight [E, H]``.
PEFT adapts parameters through ``target_parameters`` (``lora.ParamWrapper``): one LoRA per expert, saved as
``…mlp.experts.lora_A.weight [E*r, in]`` (expert e's A: rows ``e*r .. e*r+r-1``) and ``lora_B.weight
[out, r*E]`` (PEFT reads it as ``[out, r, E]``: expert e's B is every E-th column from e). Two parameters of
one module nest, the one wrapped first under ``base_layer`` (``mlp.experts.base_layer.lora_A.weight``), so a
tensor's name does not say which parameter it adapts: its shapes do (``gate_up_proj`` is ``in=H, out=2I``,
``down_proj`` ``in=I, out=H``; never both), or, for an adapter with one expert target, the config. The
router's LoRA is an ordinary pair, ``mlp.gate.lora_A.weight [r, H]``, ``lora_B.weight [E, r]``. Expert e's
weight becomes ``W_e + scaling * B_e A_e``: its output gains ``scaling * B_e (A_e x)``.

Names (``EXPERT_MODULES``): ``experts.gate_up_proj``, ``experts.down_proj``, ``router``, as the base
reports them in ``module_shapes`` (``(in, out)``; the router's ``out`` is the expert count) and as
``LoraWeights.experts`` and ``target_modules`` list them. Neither DoRA nor ``lora_bias`` applies (PEFT refuses
DoRA on parameters; one bias shared by every expert is not served).
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from loraserve.adapters.errors import AdapterError, AdapterMismatchError, AdapterRankError

# ``…layers.N.mlp.experts[.base_layer…].lora_A.weight`` / ``…mlp.gate.lora_B.weight`` (adapter name optional)
EXPERT_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe)\.(experts|gate)((?:\.base_layer)*)\.lora_(A|B)(?:\.[\w-]+)?\.(weight|bias)$"
)
GATE_UP, DOWN, ROUTER = "experts.gate_up_proj", "experts.down_proj", "router"
EXPERT_MODULES = (GATE_UP, DOWN, ROUTER)
# The most parameters ``target_parameters`` may list (PEFT matches each against every parameter name)
MAX_TARGET_PARAMETERS = 64

# The parameters PEFT's ``target_parameters`` can name here, as dotted paths ("N": a layer number); an
# entry names one when it equals a dotted suffix of the path, as PEFT matches them
_PARAMETER_PATHS = {
    GATE_UP: ("model", "layers", "N", "mlp", "experts", "gate_up_proj"),
    DOWN: ("model", "layers", "N", "mlp", "experts", "down_proj"),
    ROUTER: ("model", "layers", "N", "mlp", "gate", "weight"),
}


def _suffix_of(tail: list[str], parts: tuple[str, ...]) -> bool:
    if not 0 < len(tail) <= len(parts):
        return False
    return all(p == t or (p == "N" and t.isdigit()) for t, p in zip(tail, parts[-len(tail) :], strict=True))


# (layer, "experts" | "gate", nesting depth): one saved LoRA pair before it is named
Site = tuple[int, str, int]


def check_target_parameters(cfg: dict[str, Any]) -> tuple[str, ...]:
    """``target_parameters`` of ``adapter_config.json``: a short list of strings, each naming a parameter
    this server adapts (an MoE layer's fused experts or router); returns the expert ones it names."""
    targets = cfg.get("target_parameters") or []
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise AdapterError("target_parameters must be a list of parameter names")
    if len(targets) > MAX_TARGET_PARAMETERS:
        raise AdapterError(f"target_parameters lists {len(targets)} names, more than {MAX_TARGET_PARAMETERS}")
    if targets and cfg.get("use_dora"):
        raise AdapterError(
            "use_dora with target_parameters: DoRA on parameters is not supported (nor by PEFT)"
        )
    if targets and cfg.get("lora_bias"):
        raise AdapterError("lora_bias with target_parameters: a LoRA bias on experts is not supported")
    named = []
    for target in targets:
        hit = [name for name, parts in _PARAMETER_PATHS.items() if _suffix_of(target.split("."), parts)]
        if not hit:
            raise AdapterError(
                f"target_parameters entry {target[:128]!r} is not an adaptable parameter (an MoE layer's "
                "mlp.experts.gate_up_proj, mlp.experts.down_proj or mlp.gate.weight)"
            )
        named += [name for name in hit if name != ROUTER]
    return tuple(dict.fromkeys(named))


def expert_site(key: str, match: re.Match[str], shape: tuple[int, ...]) -> tuple[Site, str]:
    """A tensor ``EXPERT_KEY`` matched -> its site and ``A`` / ``B``; refuses biases and non-matrices."""
    layer, owner, nest, which, part = match.groups()
    _check_matrix(key, part, owner, shape)
    return (int(layer), owner, nest.count(".base_layer")), which


def _check_matrix(key: str, part: str, owner: str, shape: tuple[int, ...]) -> None:
    """A lora_A / lora_B weight of an expert tensor: no bias, two dimensions."""
    if part == "bias":
        raise AdapterError(
            f"tensor {key} is a lora_B bias on {owner}; a LoRA bias on experts is not supported"
        )
    if len(shape) != 2:
        raise AdapterError(f"tensor {key} has shape {list(shape)}; LoRA matrices are 2-D")


def name_sites(
    sites: dict[Site, dict[str, tuple[int, ...]]],
    named: tuple[str, ...],
    module_shapes: dict[str, tuple[int, int]] | None,
) -> dict[Site, str]:
    """Which parameter each site's pair adapts (module doc): the router for ``mlp.gate``; for the experts
    the one whose ``(in, out)`` the pair's shapes fit when the base is known, else the config's only expert
    target, else the shapes' relation between the two. Refuses expert tensors on a base without experts."""
    if module_shapes is not None and sites and ROUTER not in module_shapes:
        key = min(sites)  # the same site whatever order the tensors were read in
        raise AdapterMismatchError(
            f"{path_of(key, 'experts' if key[1] == 'experts' else ROUTER)}: the adapter targets a mixture of "
            "experts, and this base model has none (a dense model)"
        )
    out: dict[Site, str] = {}
    by_layer: dict[int, list[Site]] = {}
    for site, pair in sorted(sites.items()):
        if site[1] == "gate":
            out[site] = ROUTER
            continue
        for need in ("A", "B"):
            if need not in pair:
                raise AdapterError(f"{path_of(site, 'experts')}: lora_{need} is missing")
        by_layer.setdefault(site[0], []).append(site)
    for layer_sites in by_layer.values():
        fans = {s: (sites[s]["A"][1], sites[s]["B"][0]) for s in layer_sites}  # (in, out)
        if len(layer_sites) > 2:
            raise AdapterError(
                f"{path_of(layer_sites[0], 'experts')}: more than two expert parameters adapted"
            )
        for site in layer_sites:
            if module_shapes is not None:
                fits = [m for m in (GATE_UP, DOWN) if tuple(module_shapes[m]) == fans[site]]
                if not fits:
                    a, b = sites[site]["A"], sites[site]["B"]
                    raise AdapterMismatchError(
                        f"{path_of(site, 'experts')}: lora_A {list(a)} / lora_B {list(b)} fit neither "
                        f"gate_up_proj (in, out) = {tuple(module_shapes[GATE_UP])} nor down_proj "
                        f"{tuple(module_shapes[DOWN])}; the adapter was built for another base model"
                    )
                out[site] = fits[0]
            elif len(layer_sites) == 1 and len(named) == 1:
                out[site] = named[0]
            elif len(layer_sites) == 2:
                other = fans[next(s for s in layer_sites if s != site)]
                out[site] = GATE_UP if fans[site][0] == other[1] and fans[site][1] == 2 * other[0] else DOWN
            else:
                raise AdapterError(
                    f"{path_of(site, 'experts')}: cannot tell which expert parameter it adapts (list it alone "
                    "in target_parameters, or register the base model first)"
                )
        if len(layer_sites) == 2 and out[layer_sites[0]] == out[layer_sites[1]]:
            raise AdapterError(
                f"{path_of(layer_sites[0], 'experts')}: two LoRA pairs adapt the same parameter"
            )
    return out


def path_of(site: Site, name: str) -> str:
    """The parameter path rank_pattern / alpha_pattern keys match (PEFT's ``current_key``)."""
    if name == ROUTER:
        return f"model.layers.{site[0]}.mlp.gate.weight"
    return f"model.layers.{site[0]}.mlp.{name}"


def check_expert_pair(
    path: str,
    name: str,
    r: int,
    a: tuple[int, ...],
    b: tuple[int, ...],
    max_rank: int | None,
    module_shapes: dict[str, tuple[int, int]] | None,
    num_layers: int | None,
    layer: int,
) -> int:
    """One site's shapes against its rank ``r`` and the base; returns its expert count (1: the router).
    Experts: ``A [E*r, in]``, ``B [out, r*E]`` with E the base's expert count (FAILED_PRECONDITION when it
    differs); the router: ``A [r, in]``, ``B [E, r]``."""
    if max_rank is not None and r > max_rank:
        raise AdapterRankError(f"{path}: rank {r} is above the largest slot rank {max_rank}")
    if a[0] != b[1] or a[0] % r:
        raise AdapterError(
            f"{path}: lora_A {list(a)} / lora_B {list(b)} do not match rank {r} "
            "(lora_A [experts*r, in], lora_B [out, r*experts])"
        )
    experts = a[0] // r
    if name == ROUTER and experts != 1:
        raise AdapterError(f"{path}: lora_A {list(a)} / lora_B {list(b)} do not match rank {r}")
    if module_shapes is not None:
        want_in, want_out = module_shapes[name]
        if (a[1], b[0]) != (want_in, want_out):
            raise AdapterMismatchError(
                f"{path}: lora_A {list(a)} / lora_B {list(b)} expect in={want_in}, out={want_out}; "
                "the adapter was built for another base model"
            )
        base_experts = module_shapes[ROUTER][1]
        if name != ROUTER and experts != base_experts:
            raise AdapterMismatchError(
                f"{path}: lora_A {list(a)} holds {experts} experts' LoRA at rank {r}; the base model has "
                f"{base_experts} experts"
            )
    if num_layers is not None and layer >= num_layers:
        raise AdapterMismatchError(
            f"{path}: layer {layer} does not exist (the model has {num_layers} layers)"
        )
    return experts


def fold_expert(a: np.ndarray, b: np.ndarray, r: int, factor: float) -> tuple[np.ndarray, np.ndarray]:
    """PEFT's saved pair -> ``(A [E, in, r], B [E, r, out] * factor)`` float32 (the router: ``E`` = 1)."""
    from loraserve.adapters.peft_vocab import fold_scaling

    experts = a.shape[0] // r
    a_e = a.reshape(experts, r, a.shape[1]).transpose(0, 2, 1)
    b_e = b.reshape(b.shape[0], r, experts).transpose(2, 1, 0)
    return np.ascontiguousarray(a_e, np.float32), fold_scaling(np.ascontiguousarray(b_e), factor)


def stack_experts(
    by_name: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]], layers: int
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per name ``(A [L, E, in, r], B [L, E, r, out])`` (the router without ``E``), zero-padded to the
    largest rank and to ``layers`` (a layer the adapter leaves out is zeros)."""
    out = {}
    for name, by_layer in by_name.items():
        r = max(a.shape[2] for a, _ in by_layer.values())
        a0, b0 = next(iter(by_layer.values()))
        for layer, (a, b) in by_layer.items():  # an unknown base's layers could disagree
            if (a.shape[:2], b.shape[2]) != (a0.shape[:2], b0.shape[2]):
                raise AdapterError(
                    f"{name} of layer {layer}: experts/in {list(a.shape[:2])}, out {b.shape[2]} differ from "
                    f"another layer's ({list(a0.shape[:2])}, {b0.shape[2]})"
                )
        a_all = np.zeros((layers, a0.shape[0], a0.shape[1], r), np.float32)
        b_all = np.zeros((layers, a0.shape[0], r, b0.shape[2]), np.float32)
        for layer, (a, b) in by_layer.items():
            a_all[layer, :, :, : a.shape[2]] = a
            b_all[layer, :, : b.shape[1]] = b
        out[name] = (a_all[:, 0], b_all[:, 0]) if name == ROUTER else (a_all, b_all)
    return out


# The per-expert module layout before transformers 5 (``mlp.experts.<e>.gate_proj`` / ``up_proj`` /
# ``down_proj``; Mixtral's ``block_sparse_moe.experts.<e>.w1`` / ``w3`` / ``w2``): PEFT's ``target_modules``
# adapters, one ordinary LoRA per expert module. Expert e's gate and up LoRA join its fused gate/up pair
# side by side on the rank axis (``A = [A_gate | A_up]``, ``B`` block-diagonal: gate's rows to the first
# ``I`` outputs, up's to the last), so the slot's rank must hold both (``r_gate + r_up``); down is its own.
PER_EXPERT_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)"
    r"\.lora_(A|B)(?:\.[\w-]+)?\.(weight|bias)$"
)
# target_modules names of the per-expert layout beyond the dense ones: Mixtral's expert modules, a router
EXPERT_MODULE_NAMES = ("w1", "w2", "w3", "gate")
_KIND = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
# (layer, "gate" | "up" | "down") -> expert -> {"A" | "B": shape or tensor}
PerExpert = dict[tuple[int, str], dict[int, dict[str, Any]]]


def per_expert_site(
    key: str, match: re.Match[str], shape: tuple[int, ...]
) -> tuple[tuple[int, str], int, str]:
    """A tensor ``PER_EXPERT_KEY`` matched -> ``((layer, kind), expert, "A" | "B")``."""
    layer, expert, module, which, part = match.groups()
    _check_matrix(key, part, "an expert", shape)
    return (int(layer), _KIND[module]), int(expert), which


def per_expert_path(layer: int, kind: str, expert: int) -> str:
    """PEFT's module path of one expert module (what rank_pattern / alpha_pattern keys match)."""
    return f"model.layers.{layer}.mlp.experts.{expert}.{kind}_proj"


def check_per_expert(
    found: PerExpert,
    rank_of: Any,
    max_rank: int | None,
    module_shapes: dict[str, tuple[int, int]] | None,
    num_layers: int | None,
) -> dict[tuple[int, str], int]:
    """Shapes of the per-expert layout: every expert of a (layer, module) adapted once it has any (an
    expert missing from the middle or the end is refused by name: the base's count, or the largest index
    seen when the base is unknown), ``A [r, in]`` / ``B [out, r]`` at the rank ``rank_of(path)`` gives,
    fitting the base's experts, a slot rank holding gate + up. Returns each (layer, kind)'s largest rank."""
    if module_shapes is not None and found and ROUTER not in module_shapes:
        (layer, kind), experts = min(found.items())
        raise AdapterMismatchError(
            f"{per_expert_path(layer, kind, min(experts))}: the adapter targets a mixture of experts, and this "
            "base model has none (a dense model)"
        )
    count = module_shapes[ROUTER][1] if module_shapes is not None else None
    ranks: dict[tuple[int, str], int] = {}
    for (layer, kind), experts in sorted(found.items()):
        want = count if count is not None else 1 + max(experts)
        if max(experts) >= want:
            raise AdapterMismatchError(
                f"{per_expert_path(layer, kind, max(experts))}: expert {max(experts)} does not exist "
                f"(the base model has {want} experts)"
            )
        # bounded by the tensors named, not by an index a hostile file may write (experts.999999999)
        missing = [i for i in range(min(want, len(experts) + 1)) if i not in experts]
        if missing:
            raise AdapterError(
                f"{per_expert_path(layer, kind, missing[0])}: missing, while the adapter adapts {kind}_proj of "
                f"other experts of layer {layer} (experts {', '.join(map(str, missing[:8]))} have no LoRA)"
            )
        if num_layers is not None and layer >= num_layers:
            raise AdapterMismatchError(
                f"{per_expert_path(layer, kind, 0)}: layer {layer} does not exist (the model has {num_layers} layers)"
            )
        top = 0
        for expert, pair in sorted(experts.items()):
            path = per_expert_path(layer, kind, expert)
            for need in ("A", "B"):
                if need not in pair:
                    raise AdapterError(f"{path}: lora_{need} is missing")
            r, a, b = rank_of(path), tuple(pair["A"]), tuple(pair["B"])
            if a[0] != r or b[1] != r:
                raise AdapterError(
                    f"{path}: lora_A {list(a)} / lora_B {list(b)} do not match rank {r} (lora_A [r, in], lora_B [out, r])"
                )
            if module_shapes is not None:
                h, two_i = module_shapes[GATE_UP]
                want_in, want_out = (two_i // 2, h) if kind == "down" else (h, two_i // 2)
                if (a[1], b[0]) != (want_in, want_out):
                    raise AdapterMismatchError(
                        f"{path}: lora_A {list(a)} / lora_B {list(b)} expect in={want_in}, out={want_out}; "
                        "the adapter was built for another base model"
                    )
            top = max(top, r)
        ranks[(layer, kind)] = top
    for layer in sorted({layer for layer, _ in ranks}):
        fused = ranks.get((layer, "gate"), 0) + ranks.get((layer, "up"), 0)
        for kind, total in (("gate", fused), ("down", ranks.get((layer, "down"), 0))):
            if max_rank is not None and total > max_rank:
                what = (
                    "its gate_proj + up_proj ranks (they share the fused gate/up slot)"
                    if kind == "gate"
                    else "rank"
                )
                raise AdapterRankError(
                    f"{per_expert_path(layer, kind, 0)}: {what} {total} above the largest slot rank {max_rank}"
                )
    return ranks


def fold_per_expert(
    found: PerExpert, ranks: dict[tuple[int, str], int], factor_of: Any
) -> dict[str, dict[int, tuple[np.ndarray, np.ndarray]]]:
    """The checked per-expert pairs -> ``GATE_UP`` / ``DOWN`` -> layer -> ``(A [E, in, r], B [E, r, out])``
    with each module's scaling (``factor_of(path, r)``) folded into B; gate and up side by side (module
    doc), a module the layer leaves out is zeros."""
    from loraserve.adapters.peft_vocab import fold_scaling

    out: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    for layer in sorted({layer for layer, _ in found}):
        rg, ru, rd = (ranks.get((layer, k), 0) for k in ("gate", "up", "down"))
        if rg or ru:
            some = found.get((layer, "gate")) or found[(layer, "up")]
            h = some[0]["A"].shape[1]
            inter = some[0]["B"].shape[0]
            a_all = np.zeros((len(some), h, rg + ru), np.float32)
            b_all = np.zeros((len(some), rg + ru, 2 * inter), np.float32)
            for kind, offset, cols in (("gate", 0, slice(0, inter)), ("up", rg, slice(inter, 2 * inter))):
                for e, pair in found.get((layer, kind), {}).items():
                    r = pair["A"].shape[0]
                    a_all[e, :, offset : offset + r] = pair["A"].T
                    factor = factor_of(per_expert_path(layer, kind, e), r)
                    b_all[e, offset : offset + r, cols] = fold_scaling(pair["B"].T, factor)
            out.setdefault(GATE_UP, {})[layer] = (a_all, b_all)
        if rd:
            experts = found[(layer, "down")]
            inter, h = experts[0]["A"].shape[1], experts[0]["B"].shape[0]
            a_all = np.zeros((len(experts), inter, rd), np.float32)
            b_all = np.zeros((len(experts), rd, h), np.float32)
            for e, pair in experts.items():
                r = pair["A"].shape[0]
                a_all[e, :, :r] = pair["A"].T
                b_all[e, :r] = fold_scaling(pair["B"].T, factor_of(per_expert_path(layer, "down", e), r))
            out.setdefault(DOWN, {})[layer] = (a_all, b_all)
    return out
