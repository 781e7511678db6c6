"""The audit report as a practitioner reads it: the worst-case reader under each threat model, the
exact-inversion check, and their own text coming back token by token."""

from types import SimpleNamespace

import pytest

from splitleak.audit.examples import example_documents, worst_reader
from splitleak.report.audit import example_blocks
from splitleak.report.audit_prose import readers_sentence
from splitleak.report.document import TextComparison, TokenLine, render_html, render_markdown
from splitleak.runs.truth import phase_documents


def _result(attack, copy, tokens, docs, certified=None, budget=None):
    r = {
        "attack": attack,
        "config": {"client_copy": copy},
        "threat_model": copy,
        "attack_params": {} if budget is None else {"budget": budget},
        "token_recovery": tokens,
        "doc_recovery": docs,
    }
    if certified is not None:
        r["certified_tokens"] = certified
        r["mean_checks_per_token"] = 20.0
    return r


@pytest.mark.unit
def test_the_worst_reader_is_named_per_threat_model_and_overall():
    results = [
        _result("majority", "public", 0.04, 0.0),
        _result("activation", "public", 0.87, 0.05),
        _result("vmi", "public", 0.88, 0.04),
        _result("sipit", "trained", 0.96, 0.44, certified=0.97, budget=272),
    ]
    assert worst_reader(results)["attack"] == "sipit"
    # more whole documents beats more tokens: vmi reads more tokens, activation more documents
    assert worst_reader(results[:3])["attack"] == "activation"
    s = readers_sentence(results)
    assert "public pretrained weights of the client layers (activation) reads 87.00 % of tokens and 5.00 %" in s
    assert "client's trained layers (sipit budget=272, trained copy) reads 96.00 % of tokens and 44.00 %" in s
    assert "the worst is sipit budget=272, trained copy" in s
    # 97 % certified within the bound: no injectivity claim, and the sentence says what the rest were
    assert "up to 272 checks per position): 97.00 % of positions matched" in s and "injective" not in s
    assert "nearest checked candidate" in s and "ranks beyond the bound" in s
    results[-1]["certified_tokens"] = 0.999  # one position short of all is still not a certificate
    assert "injective" not in readers_sentence(results)
    results[-1]["certified_tokens"] = 1.0
    assert "the cut is injective on these documents" in readers_sentence(results)
    results[-1]["attack_params"]["budget"] = "exhaustive"
    results[-1]["certified_tokens"] = 0.5
    s = readers_sentence(results)
    assert "the whole vocabulary if needed" in s and "ranks beyond the bound" not in s
    # the control never counts as a reader, even when it reads the most
    assert worst_reader([_result("majority", "public", 0.9, 0.9), results[1]])["attack"] == "activation"


@pytest.mark.unit
def test_a_text_comparison_marks_exactly_the_wrong_tokens_and_the_spans():
    true = ["Dr", " <b>Ann", " Lee", "\n", " 42"]
    lines = [
        TokenLine("true text", true, [False] * 5, [None, "name", "name", None, "number"]),
        TokenLine("vmi (60.00 %)", ["Dr", " Anne", " Lee", "\n", " 43"], [False, True, False, False, True], [None, "name", "name", None, "number"]),
    ]  # fmt: skip
    c = TextComparison("Evaluation document 7", lines)
    page = render_html(SimpleNamespace(title="t", blocks=[c]))  # type: ignore[arg-type]
    assert page.count('class="w') == 2 and page.count('class="key w"') == 1  # the two wrong tokens; the legend
    assert page.count('class="w s-name"') == 1 and page.count('class="w s-number"') == 1
    assert "&lt;b&gt;Ann" in page and "<b>Ann" not in page  # tokens are text, never markup
    assert "⏎" in page  # a line break inside a document stays visible on one line
    assert page.count('class="key s-') == 2  # the legend names the span classes present
    md = render_markdown(SimpleNamespace(title="t", blocks=[c]))  # type: ignore[arg-type]
    assert "vmi (60.00 %) | Dr[name:⟦ Anne⟧ Lee]⏎[number:⟦ 43⟧]" in md
    assert "true text     | Dr[name: <b>Ann Lee]⏎[number: 42]" in md


@pytest.mark.integration
@pytest.mark.parametrize("seed", [0, 1])
def test_the_documents_shown_are_those_closest_to_each_readers_mean(shared_run, seed):
    run = shared_run(model="tiny-gpt2", depth=2, n_calib=4, n_train=6, n_eval=12, seed=seed, all_local_baseline=False)
    docs = phase_documents(run, "capture")
    truth = [list(d.token_ids) for d in docs]
    T = len(truth[0])
    # vmi gets document i wrong at i tokens (mean 5.5 wrong), activation at 2i mod 12 tokens
    wrong = {"vmi": list(range(12)), "activation": [(2 * i) % 12 for i in range(12)]}

    def spoil(row, n):
        return [t + 1 if j < n else t for j, t in enumerate(row)]

    predictions = {k: [spoil(truth[i], w[i]) for i in range(12)] for k, w in wrong.items()}
    results = [_result(k, "public", 0.5, 0.0) for k in wrong]
    tok = SimpleNamespace(decode=lambda ids: f"<{ids[0]}>")
    ex = example_documents(
        run, [d.doc_id for d in docs], results, predictions, SimpleNamespace(client=SimpleNamespace(tokenizer=tok))
    )
    means = {k: sum(T - n for n in w) / (12 * T) for k, w in wrong.items()}
    spread = [sum(abs((T - w[i]) / T - means[k]) for k, w in wrong.items()) / 2 for i in range(12)]
    best = sorted(range(12), key=lambda i: (spread[i], docs[i].doc_id))[:3]
    assert [d["doc_id"] for d in ex["documents"]] == [docs[i].doc_id for i in best]
    assert ex["mean_accuracy"] == pytest.approx(means)
    for d, i in zip(ex["documents"], best):
        assert d["tokens"] == [f"<{t}>" for t in truth[i]]
        for r in d["readings"]:
            assert sum(r["wrong"]) == wrong[r["attack"]][i] and r["accuracy"] == pytest.approx(1 - sum(r["wrong"]) / T)
        labelled = [s for s in d["spans"] if s is not None]
        assert len(labelled) == sum(s.token_end - s.token_start for s in docs[i].spans)
    blocks = example_blocks(ex)
    assert sum(isinstance(b, TextComparison) for b in blocks) == 3
    assert "closest to each reader's mean" in blocks[0].text  # the report says how they were picked


@pytest.mark.unit
def test_a_report_without_examples_says_so_instead_of_failing():
    (p,) = example_blocks(None)
    assert "No documents are shown (this report predates them)" in p.text
    (q,) = example_blocks({"documents": [], "how": "no tokenizer"})
    assert q.text == "No documents are shown (no tokenizer)."
