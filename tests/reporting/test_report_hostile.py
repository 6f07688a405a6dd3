"""Reports that never run a script (issue 38): a run folder whose metrics.jsonl, summary.json and config are
full of hostile keys and values (markup in metric names, ``<!--<script>``, ``</script>``, U+2028, a
``javascript:`` model path), and an evaluation summary with hostile benchmark names, render into training
and evaluation reports that real Chromium opens without running anything: no script ran, no dialog opened,
the page is whole (every chart drawn, the last section there), no link has a script scheme, and the page
carries its Content-Security-Policy. Plus fast unit tests of the escaping helpers of
``sao_core/reporting/html.py``.

Chromium is driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``), so the test reads
``window.__pwned`` and sees dialogs itself, with nothing installed beyond Chromium (as
tests/reporting/test_training_report.py, it is skipped when Chromium is not installed)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import select
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from test_training_report import _chromium

from sao_core.reporting.html import (
    Raw,
    content_security_policy,
    csp_meta,
    esc,
    link,
    safe_href,
    script_json,
    slug,
)

# ----------------------------------------------------------------------------- hostile inputs
#: metric names that broke out of the page: an ``id`` attribute, a comment that swallows the rest of the
#: page from inside the JSON data block, a script end tag, a held-out (``eval_``) chart, line separators
HOSTILE_KEYS = (
    'x"><img src=x onerror=window.__pwned=1>',
    "<!--<script>",
    "</script><script>window.__pwned=1</script>",
    "eval_'><svg onload=alert(1)>",
    "sep\u2028ara\u2029tors",
    "a&b <b>bold</b>",
)
JS_MODEL = "javascript:window.__pwned=1"
PAYLOAD = "<script>window.__pwned=1</script><img src=x onerror=window.__pwned=1>\u2028"


def hostile_rows(steps: int = 12) -> list[dict[str, Any]]:
    """metrics.jsonl lines: ordinary curves, the hostile keys as numbers, and a dict metric (one chart, one
    series per entry) whose entries are hostile too."""
    rows = []
    for step in range(1, steps + 1):
        row: dict[str, Any] = {"step": step, "loss": 2.0 / step, "reward_mean": step / steps, "lr": 1e-3}
        row.update({key: 0.1 * step + i for i, key in enumerate(HOSTILE_KEYS)})
        row["dropped_by_reason"] = {'<img src=x onerror=window.__pwned=1>': step, "<!--<script>": 1}
        rows.append(row)
    return rows


def write_hostile_run(root: Path) -> Path:
    """A run folder: metrics.jsonl of :func:`hostile_rows` and a summary.json whose names and values are
    hostile; its `model` is a bare ``javascript:`` path (inside the run when the working directory is the
    run, as with ``sao report training .``) and its critic a folder of the run named ``javascript:…``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in hostile_rows()))
    summary = {"method": "sao", "steps": 12, "model": JS_MODEL, "critic": f"{root}/javascript:window.__pwned=/x",
               PAYLOAD: PAYLOAD, "note": "line\u2028break\u2029"}
    (root / "summary.json").write_text(json.dumps(summary))
    return root


HOSTILE_CONFIG = {"method": "sao", "steps": 12, "model": JS_MODEL, PAYLOAD: PAYLOAD, "lr": 1e-3}


def hostile_evaluation() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(summary, samples) of an evaluation whose model, benchmark name and title, problem ids, groups and
    answers are hostile."""
    from sao_core.eval.metrics import benchmark_metrics

    name = 'bench"><img src=x onerror=window.__pwned=1>'
    problems = [{"id": f"p{i}<script>window.__pwned=1</script>", "topic": f"<!--<script>{i % 2}"} for i in range(3)]
    samples = [{"benchmark": name, "id": p["id"], "sample": j, "correct": j == 0, "grade": "match" if j == 0 else "mismatch",
                "grader": "rule<img src=x onerror=window.__pwned=1>", "rule": "value</script>", "status": "graded",
                "settled": True, "answer": PAYLOAD, "tokens": 10 + j, "groups": {"topic": p["topic"]}}
               for p in problems for j in range(2)]
    metrics = benchmark_metrics(problems, samples, k=2, groups=("topic",))
    bench = dict(metrics, title=f"Title {PAYLOAD}", grader="math_rule<script>window.__pwned=1</script>",
                 dataset={"source": JS_MODEL, "version": PAYLOAD, "license": PAYLOAD},
                 library_versions={PAYLOAD: PAYLOAD})
    summary = {"model": JS_MODEL, "engine": PAYLOAD, "adapter": JS_MODEL, "adapter_sha256": PAYLOAD,
               "config": {"temperature": PAYLOAD, "judge_url": JS_MODEL, "judge_model": PAYLOAD},
               "benchmarks": {name: bench}}
    return summary, samples


# ----------------------------------------------------------------------------- Chromium over DevTools
#: what the test reads from a loaded page (after half a second for late handlers: failed image loads,
#: timers); DevTools evaluation is not subject to the page's Content-Security-Policy
_PROBE = """new Promise(done => setTimeout(done, 500)).then(() => ({
  pwned: typeof window.__pwned,
  csp: [...document.querySelectorAll('meta[http-equiv="Content-Security-Policy" i]')].map(m => m.content),
  hrefs: [...document.querySelectorAll('[href]')].map(e => e.getAttribute('href')),
  handlers: [...document.querySelectorAll('*')].flatMap(e => [...e.attributes].filter(a => /^on/i.test(a.name))
                                                             .map(a => e.tagName + ' ' + a.name)),
  embedded: document.querySelectorAll('img, iframe, object, embed, frame').length,
  scripts: [...document.querySelectorAll('script')].map(s => s.type),
  headings: [...document.querySelectorAll('h1, h2, h3')].map(h => ({tag: h.tagName, id: h.id, text: h.textContent})),
  figures: [...document.querySelectorAll('figure.plot')].map(f => {
    const block = f.querySelector('script.plot-data');
    let data = null;
    try { data = JSON.parse(block.textContent); } catch (err) { data = null; }
    return {id: f.id, plot: f.dataset.plot, svgs: f.querySelectorAll('svg').length,
            data: data && data.id, series: data ? Object.keys(data.series) : null};
  }),
  svgs: document.querySelectorAll('svg').length,
  last: document.body.lastElementChild ? document.body.lastElementChild.textContent : null,
}))"""


def _above(fd: int, lowest: int) -> int:
    """A close-on-exec copy of `fd` numbered `lowest` or more; `fd` itself is closed."""
    copy = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, lowest)
    os.close(fd)
    return copy


class Browser:
    """Headless Chromium under the DevTools protocol on a pipe: Chromium reads commands on its descriptor
    3 and writes replies and events on 4, each one JSON message ended by a NUL byte. Dialogs are recorded
    and dismissed; console messages, exceptions and log entries (CSP violations among them) are recorded."""

    def __init__(self, chromium: str, profile: Path):
        to_browser, self._commands = os.pipe()
        self._replies, from_browser = os.pipe()
        # Chromium's ends are moved to 3 and 4 in the child; first lift them above 4, so that moving one
        # cannot overwrite the other (os.pipe may have handed out 3 or 4 itself).
        to_browser, from_browser = (_above(fd, 5) for fd in (to_browser, from_browser))
        self.stderr = profile.with_suffix(".log")
        args = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
                "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"]

        def pipe_to_3_and_4() -> None:     # in the child, before exec: dup2 makes 3 and 4 inheritable
            os.dup2(to_browser, 3)
            os.dup2(from_browser, 4)

        with self.stderr.open("w") as err:
            # close_fds=False keeps 3 and 4; every other descriptor of this process is close-on-exec
            self._process = subprocess.Popen([chromium, *args], preexec_fn=pipe_to_3_and_4, close_fds=False,
                                             stdin=subprocess.DEVNULL, stdout=err, stderr=err)
        os.close(to_browser)
        os.close(from_browser)
        self._buffer = b""
        self._last_id = 0
        self.dialogs: list[str] = []
        self.log: list[str] = []
        self._session = ""
        self._loaded = False

    def close(self) -> None:
        try:
            self._post("Browser.close")
            self._process.wait(timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            self._process.kill()
            self._process.wait()
        finally:
            os.close(self._commands)
            os.close(self._replies)

    def _post(self, method: str, params: dict | None = None, session: str = "") -> int:
        """Send one command without waiting for its reply; its id."""
        self._last_id += 1
        message: dict[str, Any] = {"id": self._last_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        data = json.dumps(message).encode() + b"\0"
        while data:
            data = data[os.write(self._commands, data):]
        return self._last_id

    def _receive(self, deadline: float) -> dict[str, Any]:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._replies], [], [], max(0.0, left))
            if not ready:
                raise AssertionError(f"Chromium did not answer in time; its log: {self.stderr.read_text()[-2000:]}")
            chunk = os.read(self._replies, 1 << 16)
            if not chunk:
                raise AssertionError(f"Chromium closed the pipe; its log: {self.stderr.read_text()[-2000:]}")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def call(self, method: str, params: dict | None = None, session: str = "", timeout: float = 60) -> dict:
        """Send a command and return its result, handling the events that arrive meanwhile."""
        wanted = self._post(method, params, session)
        deadline = time.monotonic() + timeout
        while True:
            message = self._receive(deadline)
            if message.get("id") == wanted:
                assert "error" not in message, f"{method}: {message['error']}"
                return message.get("result", {})
            if "method" in message and message.get("sessionId") == self._session:
                self._event(message["method"], message.get("params", {}))

    def _event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Page.javascriptDialogOpening":
            self.dialogs.append(f"{params.get('type')}: {params.get('message')}")
            self._post("Page.handleJavaScriptDialog", {"accept": True}, self._session)   # or the page hangs
        elif method == "Page.loadEventFired":
            self._loaded = True
        elif method == "Runtime.consoleAPICalled":
            self.log.append(f"console.{params.get('type')}: " + " ".join(str(a.get("value", a.get("description")))
                                                                          for a in params.get("args", [])))
        elif method == "Runtime.exceptionThrown":
            self.log.append(f"exception: {params.get('exceptionDetails', {}).get('text')}")
        elif method == "Log.entryAdded":
            entry = params.get("entry", {})
            self.log.append(f"log {entry.get('level')} {entry.get('source')}: {entry.get('text')}")

    def load(self, page: Path) -> dict[str, Any]:
        """Open `page` in a new tab, wait for its load event, and return what :data:`_PROBE` reads."""
        self.dialogs, self.log, self._loaded = [], [], False
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        self._session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for domain in ("Page", "Runtime", "Log"):
            self.call(f"{domain}.enable", session=self._session)
        self.call("Page.navigate", {"url": page.as_uri()}, session=self._session)
        deadline = time.monotonic() + 60
        while not self._loaded:
            message = self._receive(deadline)
            if "method" in message and message.get("sessionId") == self._session:
                self._event(message["method"], message.get("params", {}))
        probe = self.call("Runtime.evaluate", {"expression": _PROBE, "returnByValue": True, "awaitPromise": True},
                          session=self._session)
        assert "exceptionDetails" not in probe, probe
        self.call("Target.closeTarget", {"targetId": target})
        return probe["result"]["value"]


@pytest.fixture()
def browser(tmp_path):
    """One Chromium for the test; the harness itself is checked first: a page that runs a handler and opens
    a dialog is seen to do both."""
    chrome = Browser(_chromium(), tmp_path / "profile")
    try:
        bad = tmp_path / "bad.html"
        bad.write_text('<!DOCTYPE html><html><body><img src="x" onerror="window.__pwned=1">'
                       "<script>alert('ran')</script></body></html>")
        seen = chrome.load(bad)
        assert seen["pwned"] == "number" and chrome.dialogs == ["alert: ran"], (seen, chrome.dialogs)
        yield chrome
    finally:
        chrome.close()


_SCHEME = re.compile(r"\s*([A-Za-z][A-Za-z0-9+.-]*):")


def assert_inert(seen: dict[str, Any], chrome: Browser) -> None:
    """Nothing ran, nothing was embedded or blocked, every link is relative or http(s), the CSP is there."""
    assert seen["pwned"] == "undefined", "a script of the page ran"
    assert chrome.dialogs == [], chrome.dialogs
    assert seen["handlers"] == [] and seen["embedded"] == 0, (seen["handlers"], seen["embedded"])
    assert set(seen["scripts"]) <= {"application/json"}, seen["scripts"]
    for href in seen["hrefs"]:
        scheme = _SCHEME.match(href)
        assert not scheme or scheme.group(1).lower() in ("http", "https"), href
        assert not href.lstrip().startswith(("//", "\\\\")), href
    assert seen["csp"] == [content_security_policy()], seen["csp"]
    # The escaping alone held: the policy had nothing to refuse, and the page threw nothing.
    refused = [line for line in chrome.log if "Content Security Policy" in line or "exception" in line]
    assert not refused, refused


def assert_charts(seen: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """Every chart of the rows is on the page, drawn (one SVG in its figure) with its data block readable
    and naming the chart's own (hostile) key, under a safe element id."""
    from sao_core.reporting.training import chart_data

    charts = [chart for _, chart, _ in chart_data(rows)]
    assert [f["data"] for f in seen["figures"]] == [c.id for c in charts]
    assert [f["plot"] for f in seen["figures"]] == [c.id for c in charts]       # attribute text, unescaped
    assert [f["id"] for f in seen["figures"]] == [f"plot-{slug(c.id)}" for c in charts]
    assert all(f["svgs"] == 1 for f in seen["figures"]), seen["figures"]
    for key in HOSTILE_KEYS:
        assert any(key in c.id for c in charts), key                         # each hostile key has its chart
    drops = next(f for f in seen["figures"] if f["data"] == "drops")
    assert set(drops["series"]) == {'<img src=x onerror=window.__pwned=1>', "<!--<script>"}


# ----------------------------------------------------------------------------- the reports in Chromium
def test_a_hostile_run_s_training_report_runs_nothing_and_is_whole(tmp_path, monkeypatch, browser):
    from sao_core.reporting.training import write_training_report

    run = write_hostile_run(tmp_path / "run")
    monkeypatch.chdir(run)       # `sao report training .`: the bare `javascript:` model path lies in the run
    page = Path(write_training_report(str(run), config=HOSTILE_CONFIG))
    seen = browser.load(page)
    assert_inert(seen, browser)
    assert_charts(seen, hostile_rows())
    # The page is whole: its last section and closing line are there, after every chart.
    assert seen["headings"][-1]["text"] == "Config"
    assert seen["last"] == "Generated by sao_core.reporting.training from metrics.jsonl."
    assert seen["svgs"] == len(seen["figures"])
    # The artifacts are still linked, as relative paths whose `javascript:` is only a folder's name.
    assert "javascript%3Awindow.__pwned%3D1/" in seen["hrefs"]
    assert "javascript%3Awindow.__pwned%3D/x/" in seen["hrefs"]


def test_a_hostile_evaluation_report_runs_nothing_and_is_whole(tmp_path, monkeypatch, browser):
    from sao_core.eval.report import write_report

    run = write_hostile_run(tmp_path / "run")
    monkeypatch.chdir(run)
    summary, samples = hostile_evaluation()
    page = Path(write_report(summary, samples, str(tmp_path / "report"), training_run=str(run)))
    seen = browser.load(page)
    assert_inert(seen, browser)
    assert_charts(seen, hostile_rows())                                # the training run's section
    name, bench = next(iter(summary["benchmarks"].items()))
    heading = next(h for h in seen["headings"] if h["text"] == bench["title"])   # shown as text
    assert heading["tag"] == "H2" and heading["id"] == slug(name) and f"#{slug(name)}" in seen["hrefs"]
    assert seen["headings"][0]["text"] == f"Evaluation of {JS_MODEL} + LoRA adapter"
    assert seen["headings"][-1]["text"] == "Data set"                  # the last section of the last benchmark
    assert seen["last"].endswith("Generated by sao_core.eval.")
    # 4 evaluation charts (score, pass@k, avg per topic, length histogram) and one per training chart
    assert seen["svgs"] == 4 + len(seen["figures"])


# ----------------------------------------------------------------------------- the markup, without a browser
_ATTRIBUTE_ID = re.compile(r'\sid="([^"]*)"')


def _assert_safe_markup(html: str) -> None:
    assert html.startswith('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n' + csp_meta() + "\n")
    assert all(re.fullmatch(r"[A-Za-z0-9_-]+", value) for value in _ATTRIBUTE_ID.findall(html)), \
        _ATTRIBUTE_ID.findall(html)
    for block in re.findall(r'<script type="application/json" class="plot-data">(.*?)</script>', html, re.S):
        assert not re.search("[<>&\u2028\u2029]", block)
        json.loads(block)
    assert "<img" not in html and "<script>" not in html and 'href="javascript:' not in html.lower()


def test_the_hostile_training_report_s_markup_is_escaped(tmp_path, monkeypatch):
    from sao_core.reporting.training import build_training_report

    run = write_hostile_run(tmp_path / "run")
    monkeypatch.chdir(run)
    _assert_safe_markup(build_training_report(str(run), config=HOSTILE_CONFIG))


def test_the_hostile_evaluation_report_s_markup_is_escaped(tmp_path, monkeypatch):
    from sao_core.eval.report import render_report
    from sao_core.reporting.training import training_section

    run = write_hostile_run(tmp_path / "run")
    monkeypatch.chdir(run)
    summary, samples = hostile_evaluation()
    html = render_report(summary, samples, training=training_section(str(run)))
    _assert_safe_markup(html)
    assert "<p>3 problems × 2 samples; graded by <code>math_rule&lt;script&gt;" in html


# ----------------------------------------------------------------------------- the helpers
def test_esc_escapes_text_and_both_kinds_of_attribute_quotes():
    assert esc('x"><img src=x onerror=a>') == "x&quot;&gt;&lt;img src=x onerror=a&gt;"
    assert esc("it's & <b>") == "it&#x27;s &amp; &lt;b&gt;"
    assert esc(None) == "None" and esc(1.5) == "1.5"


def test_slug_keeps_plain_keys_and_hashes_every_other():
    assert slug("loss") == "loss" and slug("eval-eval_sampled_reward") == "eval-eval_sampled_reward"
    for key in HOSTILE_KEYS + ("", "a b", "a_b ", "é", "\ud800", "x" * 65):
        assert re.fullmatch(r"[A-Za-z0-9_-]+", slug(key)), key
        assert slug(key) != key
    assert len({slug(k) for k in ("a b", "a_b", "a-b", "a.b", "a/b", "a:b")}) == 6     # no two keys share an id
    assert slug('x"><img') == slug('x"><img')                                       # stable across renders


def test_script_json_never_ends_a_script_and_reads_back_the_same():
    value = {key: [key, "\u2028\u2029", "&amp;", "-->"] for key in HOSTILE_KEYS}
    text = script_json(value)
    assert not re.search("[<>&\u2028\u2029]", text)
    assert json.loads(text) == value
    assert script_json("</script>") == '"\\u003c/script\\u003e"'
    assert script_json("<!--") == '"\\u003c!--"'
    with pytest.raises(ValueError):
        script_json(float("nan"))


@pytest.mark.parametrize("url", ["http://example.org/a", "HTTPS://example.org/", "checkpoints/step-000002/", "./",
                                 "#plot-loss", "?q=1", "../model/", "a%3Ab/", "1abc:x"])
def test_safe_href_keeps_http_and_relative_links(url):
    assert safe_href(url) == url


@pytest.mark.parametrize("url", ["javascript:alert(1)", " JaVaScRiPt:alert(1)", "java\tscript:alert(1)",
                                 "java\nscript:alert(1)", "\x01javascript:alert(1)", "javascript:window.__pwned=1/",
                                 "data:text/html,<script>alert(1)</script>", "vbscript:msgbox(1)",
                                 "file:///etc/passwd", "//evil.example/x", "\\\\evil.example/x", "/\\evil.example",
                                 " //evil.example", "", "   ", None])
def test_safe_href_refuses_scripts_other_schemes_and_other_hosts(url):
    assert safe_href(url) is None


def test_link_shows_a_refused_url_as_text():
    assert link("javascript:alert(1)", "<x>") == "&lt;x&gt;"
    assert link("checkpoints/a b/", Raw("<code>a</code>")) == '<a href="checkpoints/a b/"><code>a</code></a>'
    assert link('a"b/', "m") == '<a href="a&quot;b/">m</a>'


def test_the_policy_runs_no_script_unless_its_hash_is_named():
    policy = content_security_policy()
    assert "script-src 'none'" in policy and "default-src 'none'" in policy and "unsafe-inline'; img" in policy
    assert "unsafe" not in policy.split("script-src")[1].split(";")[0]
    # sha256 of the exact text "alert(1)", base64 (as `openssl dgst -sha256 -binary | base64` gives it)
    assert "script-src 'sha256-bhHHL3z2vDgxUt0W3dWQOrprscmda2Y5pLsLg4GF+pI='" in content_security_policy(["alert(1)"])
    assert csp_meta() == f'<meta http-equiv="Content-Security-Policy" content="{policy.replace(chr(39), "&#x27;")}">'
