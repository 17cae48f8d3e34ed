"""`dspark generate` streams text and ends with a machine-readable statistics line; the API mirrors it."""
import re
import subprocess
import sys

import dspark


def test_generate_cli_statistics_line():
    out = subprocess.run(
        [sys.executable, "-m", "dspark.cli", "generate", "def is_even(n):", "--drafter", "ngram",
         "--max-new-tokens", "24", "--dtype", "float32"],
        capture_output=True, text=True, check=True,
    ).stdout
    last = out.strip().splitlines()[-1]
    m = re.fullmatch(r"tokens=(\d+) rounds=(\d+) tau=([\d.]+) tok/s=([\d.]+) drafter=ngram scheduler=fixed finish=(stop|length)", last)
    assert m, last
    tokens, rounds = int(m[1]), int(m[2])
    assert 0 < tokens <= 24 and 0 < rounds <= tokens
    assert abs(float(m[3]) - tokens / rounds) < 0.01


def test_python_api_matches_cli_semantics():
    target = dspark.load_target(dtype="float32")
    drafter = dspark.load_drafter("draft-model", target)
    results = dspark.generate(target, drafter, ["What is a list?", "def f(x):"], max_new_tokens=16, temperature=1.0, seed=3)
    assert len(results) == 2
    for r in results:
        assert 0 < len(r.token_ids) <= 16
        assert r.text == target.tokenizer.decode(r.token_ids, skip_special_tokens=True)
        assert sum(s.accepted + 1 for s in r.rounds) >= len(r.token_ids)
        assert all(0 <= s.accepted <= s.draft_len for s in r.rounds)


def test_generate_cli_bias_candidates_gives_the_target_only_text():
    def run(*extra):
        out = subprocess.run(
            [sys.executable, "-m", "dspark.cli", "generate", "def is_even(n):", "--max-new-tokens", "20",
             "--dtype", "float32", *extra], capture_output=True, text=True, check=True,
        ).stdout
        return out.strip().rsplit("\n", 1)

    text, stats = run("--drafter", "dspark", "--bias-candidates", "16")
    assert text == run("--drafter", "none")[0]
    assert float(re.search(r"tau=([\d.]+)", stats)[1]) > 1.0
    assert dspark.load_drafter("dspark", dspark.load_target(dtype="float32"), bias_candidates=16).bias_candidates == 16
