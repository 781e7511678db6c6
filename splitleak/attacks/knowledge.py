"""What an observer at the split holds, and nothing more.

``Knowledge`` carries a copy of the client's layers (embeddings and blocks [0, cut), built from the
public pretrained weights or from the run's trained client layers), the token embedding matrix and
the public calibration documents. It cannot carry the server's layers, the labels or the
evaluation text: the copy is physically truncated at the cut (the blocks after it are dropped and
the final norm replaced by the identity), and the calibration documents come from their own
section of ``documents.json``.

``Traffic`` is what the observer recorded: activations and, in training, the returned gradients.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from splitleak.attacks.candidate_attention import extend_attention
from splitleak.attacks.registry import COPIES
from splitleak.data import Document
from splitleak.defences import build_defence
from splitleak.errors import ConfigError, IntegrityError
from splitleak.models import load_model
from splitleak.models.split import SplitModel
from splitleak.models.structure import _NORM_NAMES, find_blocks
from splitleak.runs.captures import Capture, load_capture
from splitleak.runs.journal import read_tensors_and_metadata
from splitleak.runs.manifest import read_calibration, read_manifest, run_mode
from splitleak.seeds import model_init_seed
from splitleak.training.config import ShieldedConfig, draws_of


class ClientCopy:
    """The attacker's copy of the client layers: token ids in, activations at the cut out."""

    def __init__(self, model: nn.Module, cut: int, tokenizer: Any = None):
        owner, blocks, attr = find_blocks(model)
        if not 1 <= cut <= len(blocks):
            raise ConfigError(f"cut {cut} does not fit a model with {len(blocks)} blocks")
        self.blocks = nn.ModuleList(list(blocks)[:cut])
        setattr(owner, attr, self.blocks)
        if hasattr(owner.config, "num_hidden_layers"):
            owner.config.num_hidden_layers = cut
        if hasattr(owner.config, "n_layer"):
            owner.config.n_layer = cut
        for name in _NORM_NAMES:
            if isinstance(getattr(owner, name, None), nn.Module):
                setattr(owner, name, nn.Identity())
        self.owner = owner.eval()
        for p in self.owner.parameters():
            p.requires_grad_(False)
        self.cut = cut
        self.tokenizer = tokenizer
        self.embedding = owner.get_input_embeddings().weight.detach()

    @functools.cached_property
    def cache_keyword(self) -> str:
        """The keyword ``extend`` passes the key/value cache by; looked up on first use, so that a copy the
        prefix search never runs does not depend on it."""
        return cache_keyword(self.owner)

    @functools.cached_property
    def sliding_blocks(self) -> list[int]:
        """The blocks of this copy that attend through a sliding window (transformers' ``layer_types``)."""
        kinds = list(getattr(self.owner.config, "layer_types", None) or [])[: self.cut]
        return [i for i, kind in enumerate(kinds) if kind == "sliding_attention"]

    @property
    def dtype(self) -> torch.dtype:
        return self.embedding.dtype

    @property
    def device(self) -> torch.device:
        return self.embedding.device

    @property
    def vocab_size(self) -> int:
        return int(self.embedding.shape[0])

    def to(self, device) -> "ClientCopy":
        self.owner.to(device)
        self.embedding = self.owner.get_input_embeddings().weight.detach()
        return self

    @torch.no_grad()
    def activations(self, input_ids: torch.Tensor, batch: int = 64) -> torch.Tensor:
        """Activations at the cut for full sequences [n, T] -> [n, T, d]."""
        out = []
        for s in range(0, input_ids.shape[0], batch):
            ids = input_ids[s : s + batch].to(self.device)
            out.append(self.owner(input_ids=ids, use_cache=False).last_hidden_state)
        return torch.cat(out)

    def new_cache(self):
        # lazy: transformers only where a model runs: reports and the results store load this module without one
        from transformers import DynamicCache

        return DynamicCache(config=self.owner.config)

    @torch.no_grad()
    def extend(self, cache, candidates: torch.Tensor, position: int) -> torch.Tensor:
        """Activations of ``k`` alternative next tokens for each of ``n`` cached prefixes of length
        ``position``, in one forward pass: ``candidates`` [n, k] -> [n, k, d]. Each candidate attends
        to its prefix and itself only, at position id ``position``: by ``attacks.candidate_attention``,
        linear in k, or where that does not apply by transformers' attention under a 4-D mask. The cache
        grows by ``k`` entries per row; ``select_cache`` keeps the chosen ones."""
        n, k = candidates.shape
        if self.sliding_blocks:  # their cache keeps only the window, which the candidates' mask does not know
            raise ConfigError(
                f"the prefix search (beam search, SipIt) does not support sliding-window attention: blocks "
                f"{self.sliding_blocks} of this copy attend through a window of "
                f"{getattr(self.owner.config, 'sliding_window', '?')} tokens; "
                "cut before them or use a model without a sliding window"
            )
        mask = torch.zeros(n, 1, k, position + k, dtype=torch.bool, device=self.device)
        mask[..., :position] = True
        idx = torch.arange(k, device=self.device)
        mask[:, 0, idx, position + idx] = True
        pos = torch.full((n, k), position, dtype=torch.long, device=self.device)
        before = _cached_length(cache)
        with extend_attention(self.owner.config, position, k):  # linear in k (``attacks.candidate_attention``)
            out = self.owner(
                input_ids=candidates.to(self.device),
                position_ids=pos,
                attention_mask=mask,
                use_cache=True,
                **{self.cache_keyword: cache},
            )
        if _cached_length(cache) != before + k:
            raise RuntimeError(
                f"the client copy's forward did not fill the key/value cache passed as {self.cache_keyword!r} "
                f"(transformers {_transformers_version()}): the prefix search needs it; report this with the version"
            )
        return out.last_hidden_state


def _cached_length(cache) -> int:
    keys = cache.layers[0].keys if cache.layers else None
    return 0 if keys is None else int(keys.shape[-2])


def cache_keyword(module: nn.Module) -> str:
    """The keyword a transformers model's forward takes its key/value cache by: ``cache`` from transformers
    5.2x on, ``past_key_values`` before (5.17 takes only that, and silently drops an unknown ``cache=``)."""
    params = inspect.signature(module.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise ConfigError(f"{type(module).__name__}.forward takes no key/value cache (neither cache nor past_key_values)")


def _transformers_version() -> str:
    # lazy: transformers only where a model runs: reports and the results store load this module without one
    import transformers

    return transformers.__version__


def select_cache(cache, position: int, parent: torch.Tensor, choice: torch.Tensor | None) -> None:
    """Keep, for new row r, the prefix of row ``parent[r]`` and (when ``choice`` is given) the entry
    of its candidate ``choice[r]`` appended by ``ClientCopy.extend``."""
    for layer in cache.layers:
        for attr in ("keys", "values"):
            t = getattr(layer, attr)
            prefix = t[parent, :, :position]
            if choice is not None:
                picked = t[parent, :, position + choice].unsqueeze(2)
                prefix = torch.cat([prefix, picked], dim=2)
            setattr(layer, attr, prefix.contiguous())


class PublicTop:
    """The proxy Top of the gradient-matching attacks (GMA-SL, 003 §2-3): the *pretrained* blocks after the
    server's Trunk, the final norm and the head, frozen; the semi-white-box attacker knows the checkpoint,
    not the client's fine-tuned Top. Called on trunk outputs [b, T, H], it returns logits [b, T, V]."""

    def __init__(self, lm, split: dict[str, Any]):
        if not split.get("label_shielded"):
            raise ConfigError("the proxy Top is the label-shielded mode's: this run keeps no Top on the client")
        top = int(split["n_blocks"]) - int(split["server_end"])
        self.split = SplitModel(lm, shielded=ShieldedConfig(bottom=int(split["cut"]), top=top))
        for p in lm.model.parameters():
            p.requires_grad_(False)
        self.vocab_size = int(self.split.head.weight.shape[0])

    @property
    def device(self) -> torch.device:
        return self.split.device

    @property
    def dtype(self) -> torch.dtype:
        return self.split.dtype

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.split.head_logits(h, self.split.context(h.shape[0], h.shape[1]))

    def hidden(self, h: torch.Tensor) -> torch.Tensor:
        """The final hidden state [b, T, H] the head reads (``gma-sl``'s ``candidates``)."""
        return self.split.head_hidden(h, self.split.context(h.shape[0], h.shape[1]))

    @property
    def head(self) -> torch.nn.Module:
        return self.split.head

    @property
    def softcap(self) -> float | None:
        return self.split._softcap


@dataclass
class Knowledge:
    """The attacker's side information. No server layers, no labels, no evaluation text. ``top``: the
    pretrained Top, for the attacks that match output gradients (label-shielded runs).

    Kerckhoffs: the attacker knows the defence chain's mechanism and public arguments (``defences``, the
    manifest's record of names and arguments; no seed, no secret), the split mode, and whether the
    client's random draws are keyed by its run seed (``draws``: "derived") or drawn fresh from OS entropy
    ("os"). ``history`` gives the traffic the observer saw before the traffic it attacks (the training
    steps, when it attacks the capture pass), as ``Traffic``; None where there is none."""

    client: ClientCopy
    calibration: tuple[Document, ...]
    copy: str
    model: str
    top: PublicTop | None = None
    defences: tuple[dict[str, Any], ...] = ()
    mode: str = "plain"
    draws: str = "derived"
    history_loader: Callable[[], "Traffic"] | None = dataclasses.field(default=None, repr=False, compare=False)
    #: what several attacks compute from this knowledge alone (the ridge fit) or from it and one traffic
    #: (candidate lists): computed once, shared by every attack fitted on this object (an audit's suite);
    #: not an init field, so ``dataclasses.replace(knowledge, client=other)`` starts with an empty one
    shared: dict[Any, Any] = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)
    #: the attacks (unfitted) that will run on this knowledge, each on the same traffic (a grid worker's attack
    #: jobs of one run and copy), so that one can serve its siblings' results from one computation where they
    #: are provably the same (SipIt's budgets); not an init field either
    planned: tuple[Any, ...] = dataclasses.field(default_factory=tuple, init=False, repr=False, compare=False)

    def calibration_ids(self) -> torch.Tensor:
        return torch.tensor([list(d.token_ids) for d in self.calibration], dtype=torch.long)

    def chain(self) -> list[Any]:
        """The run's defences rebuilt from their public record (``splitleak.defences.build_defence``), in chain
        order, without ``none``; no seed or secret goes into them."""
        return [build_defence(d["name"], d.get("args")) for d in self.defences if d["name"] != "none"]

    def history(self) -> "Traffic | None":
        """The traffic the observer saw before (loaded once per knowledge), or None."""
        if self.history_loader is None:
            return None
        return self.memo("history", self.history_loader)

    def memo_content(self, key: Any, parts: tuple[Any, ...], compute: Callable[[], Any]) -> Any:
        """``compute()``, once per ``key`` and the content of ``parts`` (``tensor_digest``: each tensor's dtype,
        shape and bytes), for a value that is a function of those parts and this knowledge alone and is
        deterministic on a machine and thread count, such as a search over a traffic's activations. A second
        traffic with the same rows in the same order gets what computing it again gives, bit for bit, without
        the work: the mis-paired twin of a traffic it covers whole holds the arm's rows, in the arm's order,
        under other documents' ids (``splitleak.audit.evaluate.mispaired_control``). Nothing but ``parts`` is
        in the key: what a reader does with the documents' ids happens outside it, and its twin still sees it.
        The latest ``MEMO_CONTENTS`` values are kept; a move to another device starts afresh."""
        slot = ("content", key, tensor_digest(*parts), str(self.client.device))
        order = self.shared.setdefault(("content-order",), [])
        if slot in self.shared:
            order.remove(slot)
            order.append(slot)
            return self.shared[slot]
        value = compute()
        self.shared[slot] = value
        order.append(slot)
        while len(order) > MEMO_CONTENTS:
            self.shared.pop(order.pop(0), None)
        return value

    def memo(self, key: Any, compute: Callable[[], Any], traffic: "Traffic | None" = None, whole: bool = False) -> Any:
        """``compute()``, once per ``key`` and, for a value that depends on the traffic, per ``traffic``: told
        apart by its activations tensor (a value of the activations alone: the traffic with other gradients is
        the same), or with ``whole`` by the ``Traffic`` object itself. The values of the ``MEMO_TRAFFICS``
        latest traffics are kept (a grid worker's jobs read one traffic in turn, each with a mis-paired twin;
        an audit's calibration doses each read their own, and do not pile up). The client copy must not change
        after the first call (an attack that changes it works on a copy: ``dataclasses.replace``); a move to
        another device starts afresh."""
        slot = (key, str(self.client.device))
        seen = None if traffic is None else traffic if whole else traffic.activations
        kept = self.shared.setdefault(slot, [])
        for i, (activations, value) in enumerate(kept):
            if activations is seen:
                kept.append(kept.pop(i))  # the most recently used last
                return value
        value = compute()
        kept.append((seen, value))
        del kept[:-MEMO_TRAFFICS]
        return value


def tensor_digest(*parts: Any) -> str:
    """A digest of tensors and plain values: each tensor's dtype, shape and bytes, each other value's repr."""
    h = hashlib.sha256()
    for x in parts:
        if isinstance(x, torch.Tensor):
            t = x.detach().contiguous().cpu()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(x).encode())
        h.update(b"|")
    return h.hexdigest()


#: values ``Knowledge.memo_content`` keeps (the latest): a grid worker's group reads a few dozen searches
MEMO_CONTENTS = 64

#: traffics whose values ``Knowledge.memo`` keeps per key (the latest): a grid worker's group reads its traffic
#: and, for each attack seed and each perturbation of its gradients, a mis-paired twin of it
#: (``audit.evaluate.mispaired_control``): paper_main's undefended group has 11 activation tensors (the traffic,
#: and two seeds' twins of it and of its four perturbations); what one entry holds is small (a ranked list, a
#: twin of 16 documents)
MEMO_TRAFFICS = 16


@dataclass
class Traffic:
    """What the observer recorded, per document (rows in capture order). Besides the activations
    and returned gradients of the observation point, where the run's wire carries them: mixup's
    probe rows paired with each document (``probe_activations``, ``probe_gradients``; documents whose
    frame carried none, mixup's unmixed warm-up steps, have ``probe_present`` False), the U-shape's
    trunk output and the output gradient the client returns for it, and each frame's step."""

    doc_ids: tuple[int, ...]
    activations: torch.Tensor  # [n, T, d]
    gradients: torch.Tensor | None  # [n, T, d] or None (inference traffic)
    probe_activations: torch.Tensor | None = None
    probe_gradients: torch.Tensor | None = None
    probe_present: torch.Tensor | None = None  # [n] bool
    trunk_output: torch.Tensor | None = None
    output_gradients: torch.Tensor | None = None
    steps: tuple[int, ...] | None = None
    phase: str = "capture"
    frames: tuple[int, ...] | None = None  # the frame each row crossed in (a loss normalises over its frame)

    _ROWS = (
        "activations",
        "gradients",
        "probe_activations",
        "probe_gradients",
        "probe_present",
        "trunk_output",
        "output_gradients",
    )

    def __len__(self) -> int:
        return len(self.doc_ids)

    @classmethod
    def from_capture(cls, cap: Capture, with_gradients: bool = True) -> "Traffic":
        """``with_gradients`` False: inference traffic, without the gradients (the activations, probe
        rows and a U-shape's trunk output cross in inference too)."""
        return cls(
            tuple(int(i) for i in cap.doc_ids),
            cap.activations,
            cap.gradients if with_gradients else None,
            cap.probe_activations,
            cap.probe_gradients if with_gradients else None,
            cap.probe_present,
            cap.trunk_output,
            cap.output_gradients if with_gradients else None,
            None if cap.steps is None else tuple(int(s) for s in cap.steps),
            cap.phase,
            None if cap.frames is None else tuple(int(f) for f in cap.frames),
        )

    def replace(self, **fields) -> "Traffic":
        return dataclasses.replace(self, **fields)

    def subset(self, rows: Sequence[int]) -> "Traffic":
        rows = list(rows)
        picked: dict[str, Any] = {k: (None if getattr(self, k) is None else getattr(self, k)[rows]) for k in self._ROWS}
        return Traffic(
            tuple(self.doc_ids[i] for i in rows),
            **picked,
            steps=None if self.steps is None else tuple(self.steps[i] for i in rows),
            phase=self.phase,
            frames=None if self.frames is None else tuple(self.frames[i] for i in rows),
        )


def _public_model(m: dict[str, Any], run_dir, lm=None):
    """The run's public pretrained model (``lm`` when the caller has it loaded), checked against the
    fingerprint the run recorded."""
    cfg = m["config"]
    if lm is None:
        lm = load_model(
            cfg["model"],
            precision=cfg["precision"],
            seed=model_init_seed(cfg["seed"]),
            model_path=cfg.get("model_path"),
        )
    want = (m.get("model") or {}).get("fingerprint")
    got = want if want is None else lm.fingerprint(as_loaded=True)  # loaded just now, or a pristine copy
    if got != want:
        raise IntegrityError(
            f"the public model loaded for {run_dir} (fingerprint {str(got)[:12]}) is not the one the run "
            f"started from ({str(want)[:12]}): another version of the weights, or a tiny-model run written before "
            "splitleak derived the model's init seed from the run seed (train it again)"
        )
    return lm


def public_model(run_dir: str | Path, lm=None):
    """The run's public pretrained model (what every attacker of it may hold, and the prior of its bound), checked
    against the fingerprint the run recorded."""
    return _public_model(read_manifest(run_dir), run_dir, lm)


def load_knowledge(run_dir: str | Path, copy: str = "public", lm=None, with_top: bool = False) -> Knowledge:
    """The attacker's knowledge for a run: its client-layer copy and the calibration documents; with
    ``with_top``, the pretrained Top too (a second load of the public weights)."""
    if copy not in COPIES:
        raise ConfigError(
            f"unknown copy {copy!r}; use public (pretrained weights) or trained (the run's client layers)"
        )
    m = read_manifest(run_dir)
    cfg = m["config"]
    top = PublicTop(_public_model(m, run_dir), m["split"]) if with_top else None
    lm = _public_model(m, run_dir, lm)
    client = ClientCopy(lm.model, m["split"]["cut"], lm.tokenizer)
    if copy == "trained":
        state, meta = read_tensors_and_metadata(run_dir, "client_layers.safetensors")
        trained_for = meta.get("config_hash")
        if trained_for is not None and trained_for != m.get("config_hash"):  # older runs record none
            raise IntegrityError(
                f"{run_dir}/client_layers.safetensors holds the client layers of another run (trained under "
                f"configuration {str(trained_for)[:12]}, this run's manifest records {str(m.get('config_hash'))[:12]}): "
                "they were copied in and the journal rewritten; restore the run's own file or retrain it, or use "
                "--copy public"
            )
        try:
            missing, unexpected = lm.model.load_state_dict(state, strict=False)
        except RuntimeError as exc:  # a tensor whose shape differs from the model's
            detail = next((ln.strip() for ln in str(exc).splitlines() if "size mismatch" in ln), str(exc)[:200])
            raise IntegrityError(
                f"{run_dir}/client_layers.safetensors does not fit the model {cfg['model']} ({detail}); the run was "
                "written for another model, or the file was altered: run `splitleak verify` on it"
            ) from None
        if unexpected:
            raise IntegrityError(
                f"client_layers.safetensors holds tensors this model does not have ({unexpected[:3]}...); "
                "the run was written for another model"
            )
        client.embedding = client.owner.get_input_embeddings().weight.detach()
    return Knowledge(
        client,
        read_calibration(run_dir),
        copy,
        cfg["model"],
        top,
        defences=tuple(m.get("defences") or ()),
        mode=run_mode(m),
        draws=draws_of(cfg),
        history_loader=lambda: load_traffic(run_dir, phase="train"),
    )


def load_traffic(
    run_dir: str | Path, with_gradients: bool = True, phase: str = "capture", link: str | None = None
) -> Traffic:
    """The recorded traffic of one phase (``capture``: the evaluation documents; ``train``: one
    frame per training step) on one link (default ``main``, or the first server copy)."""
    return Traffic.from_capture(load_capture(run_dir, phase, link), with_gradients)
