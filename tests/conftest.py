import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the hub is not reachable here; fail fast instead of retrying
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("SPLITLEAK_SHARED", REPO.parent / "shared"))
WIKITEXT = SHARED / "data" / "wikitext-2-raw"
GPT2_TOKENIZER = SHARED / "data" / "gpt2-tokenizer"


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def wikitext_dir():
    if not (WIKITEXT / "wiki.test.raw").is_file():
        pytest.skip(f"WikiText-2 raw not found at {WIKITEXT} (set SPLITLEAK_SHARED)")
    return WIKITEXT


@pytest.fixture(scope="session")
def smollm2():
    from splitleak.models import preset_available

    ok, why = preset_available("smollm2-135m")
    if not ok:
        pytest.skip(f"smollm2-135m unavailable: {why}")
    return True
