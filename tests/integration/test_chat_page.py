"""The chat page (/chat) and the dashboard's live charts in Chromium, driven by
Playwright (Debian's chromium; no browser is ever downloaded), against real node
processes: a and b serve the worded tiny model (blocks 0:2 and 2:4), c serves
another tiny model whole, so a's model picker lists the swarm's two models; a holds
an adapter for the first, so its adapter picker shows for that model only.

In the page: a reply streams (its text grows over several DOM updates and ends as
greedy decoding in one process answers), its route names a and b with their blocks,
and its figures show; an unknown model's error, and one inside a stream, are shown
as the node words them; the toggles and the adapter picker reach the request; Stop
mid-reply ends the reply where it was and the servers' sessions close; Regenerate
answers again; the conversations survive a reload. Then the dashboard charts a's
last minutes.

Screenshots: every run saves tests/artifacts/chat_page.png (after the first reply),
chat_page_dark_narrow.png (dark colour scheme, a phone's width) and
dashboard_charts.png (the folder is gitignored; each run overwrites the last
run's)."""

import json
import shutil
import urllib.request
from pathlib import Path

import pytest
import trio

from compushare.app.api.auth import TOKEN_FILE
from compushare.app.api.engine import messages_to_ids
from compushare.model import adapter_file
from compushare.model.arch import load_config
from compushare.model.catalog import import_path
from helpers import random_adapter, reference_greedy, wait_until

pytestmark = pytest.mark.integration

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(__file__).resolve().parents[1] / "artifacts"
QUESTION, LONG_QUESTION = "w5 w6 w7 w8", "w10 w11 w12"  # greedy answers with no end of sequence for 480 tokens
REPLY_TOKENS, LONG_TOKENS = 40, 480  # the tiny model has 512 positions
WAIT_MS = 60_000  # every wait in the page: generous (a loaded machine is slow), never endless

# Records the reply's length at every change of the messages' DOM (the page sets
# the whole text at each piece): how the text grew.
WATCH_GROWTH = """() => {
  window.lengths = [];
  new MutationObserver(() => {
    const content = document.querySelector("#messages .msg.assistant:last-child .content");
    if (content) window.lengths.push(content.textContent.length);
  }).observe(document.getElementById("messages"), {childList: true, subtree: true, characterData: true});
}"""
LAST_REPLY = "#messages .msg.assistant:last-child"
STREAM_WITH_ERROR = "".join(f"data: {json.dumps(event)}\n\n" for event in (
    {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "w7"}}]},
    {"error": {"message": "the swarm cannot serve this model now: no route", "type": "server_error"}},
)) + "data: [DONE]\n\n"


def _control(state: dict, data_dir: Path, path: str) -> dict:
    token = (data_dir / TOKEN_FILE).read_text().strip()
    request = urllib.request.Request(f"{state['api']}{path}", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def _expected_reply(model_dir: Path, question: str, tokens: int) -> str:
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    ids = reference_greedy(model_dir, messages_to_ids(tokenizer, [{"role": "user", "content": question}]), tokens)
    assert 2 not in ids, "the tiny model ends this answer early: pick another question"
    return tokenizer.decode(ids, skip_special_tokens=True)


def _set(page, selector: str, value: str) -> None:
    """A form control's value, as a person's input would set it (range inputs too)."""
    page.eval_on_selector(selector, """(e, v) => { e.value = v; e.dispatchEvent(new Event("input"));
                                                   e.dispatchEvent(new Event("change")); }""", value)


def _ask(page, question: str, max_tokens: int) -> None:
    _set(page, "#max-tokens", str(max_tokens))
    page.fill("#prompt", question)
    page.press("#prompt", "Enter")


def _chat_in_chromium(url: str, swarm: dict) -> dict:
    """Everything a person does in the chat page; what the test checks afterwards."""
    from playwright.sync_api import sync_playwright

    seen: dict = {}
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(WAIT_MS)
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(url)
            page.wait_for_function("document.querySelectorAll('#model option').length >= 2", timeout=WAIT_MS)
            seen["models"] = page.eval_on_selector_all("#model option", "os => os.map(o => o.value)")
            page.select_option("#model", "tiny")
            seen["adapters"] = page.eval_on_selector_all("#adapter option", "os => os.map(o => o.value)")
            seen["adapter_shown"] = page.is_visible("#adapter")
            page.select_option("#model", "other")
            seen["adapter_shown_for_other"] = page.is_visible("#adapter")
            page.select_option("#model", "tiny")

            # An unknown model: the node's error, shown as it words it.
            page.eval_on_selector("#model", """m => { const o = document.createElement("option");
                                                     o.value = o.textContent = "no-such-model"; m.append(o);
                                                     m.value = "no-such-model"; }""")
            _ask(page, QUESTION, 8)
            page.wait_for_selector(f"{LAST_REPLY}[data-state=error]", timeout=WAIT_MS)
            seen["error"] = page.text_content("#error")
            page.click("#chats li.current .delete")
            page.select_option("#model", "tiny")

            # The extensions a request carries, and an error inside the stream (the node's
            # answer replaced here, in the browser: a private generation takes minutes).
            asked: list = []

            def fake_stream(route) -> None:
                asked.append(route.request.post_data_json)
                route.fulfill(status=200, content_type="text/event-stream", body=STREAM_WITH_ERROR)

            page.route("**/v1/chat/completions", fake_stream)
            page.select_option("#adapter", "style")
            page.click("#settings summary")  # open the settings
            page.check("#private")
            page.check("#standby")
            _ask(page, QUESTION, 8)
            page.wait_for_selector(f"{LAST_REPLY}[data-state=error]", timeout=WAIT_MS)
            page.unroute("**/v1/chat/completions")
            seen["asked"], seen["stream_error"] = asked, page.text_content("#error")
            seen["partial"] = page.text_content(f"{LAST_REPLY} .content")
            page.uncheck("#private")
            page.uncheck("#standby")
            page.click("#settings summary")
            page.select_option("#adapter", "")
            page.click("#chats li.current .delete")

            # A reply streams, token by token.
            _set(page, "#temperature", "0")  # greedy: the reply one process answers
            page.evaluate(WATCH_GROWTH)
            _ask(page, QUESTION, REPLY_TOKENS)
            page.wait_for_selector(f"{LAST_REPLY}[data-state=done]", timeout=WAIT_MS)
            seen["lengths"] = page.evaluate("window.lengths")
            seen["reply"] = page.text_content(f"{LAST_REPLY} .content")
            seen["route"] = page.eval_on_selector_all(f"{LAST_REPLY} .hop", """hs => hs.map(
                h => [h.querySelector(".peer").textContent, h.querySelector(".span").textContent])""")
            seen["stats"] = page.text_content(f"{LAST_REPLY} .stats")
            page.screenshot(path=str(ARTIFACTS / "chat_page.png"), full_page=True)

            # Stop mid-reply: the text stops growing, the servers' sessions close.
            page.click("#new-chat")
            _ask(page, LONG_QUESTION, LONG_TOKENS)
            page.wait_for_function(f"""() => {{ const c = document.querySelector("{LAST_REPLY} .content");
                                              return c && c.textContent.split(" ").length >= 10; }}""",
                                   timeout=WAIT_MS)
            seen["sessions_while_streaming"] = {name: _control(*swarm[name], "/control/status")["sessions"]
                                                for name in ("a", "b")}
            page.click("#stop")
            page.wait_for_selector(f"{LAST_REPLY}[data-state=stopped]", timeout=WAIT_MS)
            stopped = page.text_content(f"{LAST_REPLY} .content")
            page.wait_for_timeout(2000)
            seen["stopped"], seen["after_stop"] = stopped, page.text_content(f"{LAST_REPLY} .content")
            for name in ("a", "b"):
                wait_until(lambda name=name: _control(*swarm[name], "/control/status")["sessions"] == 0,
                           f"{name}'s sessions closed after Stop", timeout=30)

            # Regenerate the stopped reply; the conversations survive a reload.
            _set(page, "#max-tokens", "6")
            page.click("#regenerate")
            page.wait_for_selector(f"{LAST_REPLY}[data-state=done]", timeout=WAIT_MS)
            seen["after_regenerate"] = page.eval_on_selector_all("#messages .msg", "ms => ms.map(m => m.className)")
            page.reload()
            page.wait_for_function("document.querySelectorAll('#chats li').length === 2", timeout=WAIT_MS)
            page.click("#chats li:last-child")
            page.wait_for_selector(f"{LAST_REPLY}[data-state=done]", timeout=WAIT_MS)
            seen["reply_after_reload"] = page.text_content(f"{LAST_REPLY} .content")
            page.emulate_media(color_scheme="dark")  # how it looks on a phone at night
            page.set_viewport_size({"width": 390, "height": 844})
            page.screenshot(path=str(ARTIFACTS / "chat_page_dark_narrow.png"), full_page=True)
            seen["page_errors"] = errors
        finally:
            browser.close()
    return seen


def _charts_in_chromium(url: str) -> dict:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(url)
            page.wait_for_function("""['steps', 'tokens', 'kv', 'peers'].every(
                name => document.querySelectorAll('#chart-' + name + ' path.series').length >= 1)""",
                                   timeout=WAIT_MS)
            legends = {name: page.text_content(f"#chart-{name} .legend") for name in ("steps", "tokens", "kv", "peers")}
            page.locator("#charts").screenshot(path=str(ARTIFACTS / "dashboard_charts.png"))
            return {"legends": legends, "error": page.text_content("#error")}
        finally:
            browser.close()


@pytest.mark.skipif(CHROMIUM is None, reason="`make test` installs chromium (Debian package)")
async def test_chat_page_streams_stops_and_shows_the_route_and_the_dashboard_charts(
        processes, worded_model, other_tiny_model, tmp_path):
    ARTIFACTS.mkdir(exist_ok=True)
    ads = ["--ad-period", "1", "--api-port", "0"]
    _, a = processes.node("a", worded_model, "0:2", extra=ads)
    boot = a["addrs"][:1]
    b_proc, _ = processes.node("b", worded_model, "2:4", bootstrap=boot, extra=ads, wait=False)
    c_proc, _ = processes.node("c", other_tiny_model, "0:4", alias="other", bootstrap=boot, extra=ads, wait=False)
    b = processes.ready("b", b_proc)
    processes.ready("c", c_proc)
    a_dir, b_dir = processes.root / "a", processes.root / "b"
    model_id = import_path(worded_model, tmp_path / "ids", alias="tiny").model_id
    (a_dir / "adapters").mkdir()
    adapter_file.save(random_adapter(load_config(worded_model), seed=3, model_id=model_id),
                      a_dir / "adapters" / "style.safetensors")
    expected = _expected_reply(worded_model, QUESTION, REPLY_TOKENS)

    with trio.fail_after(60):  # a knows both models, each served whole
        while True:
            models = {m["name"]: m for m in _control(a, a_dir, "/control/models")["models"]}
            if {"tiny", "other"} <= set(models) and all(models[n]["complete"] for n in ("tiny", "other")):
                break
            await trio.sleep(0.5)
    token = (a_dir / TOKEN_FILE).read_text().strip()
    swarm = {"a": (a, a_dir), "b": (b, b_dir)}
    seen = await trio.to_thread.run_sync(_chat_in_chromium, f"{a['api']}/chat#token={token}", swarm)

    assert {"tiny", "other"} <= set(seen["models"])
    assert seen["adapters"] == ["", "style"] and seen["adapter_shown"] and not seen["adapter_shown_for_other"]
    assert "no-such-model" in seen["error"]
    (asked,) = seen["asked"]
    assert asked["private"] is True and asked["standby"] is True and asked["adapter"] == "style"
    assert asked["stream"] is True and asked["route"] is True and asked["max_tokens"] == 8
    assert asked["messages"] == [{"role": "user", "content": QUESTION}] and asked["model"] == "tiny"
    assert seen["stream_error"] == "the swarm cannot serve this model now: no route" and seen["partial"] == "w7"
    growth = sorted(set(seen["lengths"]))
    assert len(growth) >= 5 and growth[-1] == len(seen["reply"]), growth  # it grew over several DOM updates
    assert seen["reply"] == expected
    assert sorted(seen["route"]) == sorted([[a["peer_id"], "blocks 0:2"], [b["peer_id"], "blocks 2:4"]])
    assert "tokens/s" in seen["stats"] and "first token" in seen["stats"] and "server:" in seen["stats"]
    assert seen["sessions_while_streaming"]["a"] >= 1 and seen["sessions_while_streaming"]["b"] >= 1
    assert seen["after_stop"] == seen["stopped"]  # no more text once stopped
    assert 10 <= len(seen["stopped"].split()) < LONG_TOKENS
    assert seen["after_regenerate"] == ["msg user", "msg assistant"]
    assert seen["reply_after_reload"] == expected
    assert seen["page_errors"] == []

    history = _control(a, a_dir, "/control/dashboard")["history"]
    assert max(r for r in history["tokens_s"] if r is not None) > 0 and history["kv_total"][-1] > 0
    assert history["peers"][-1] == 2  # b and c
    charts = await trio.to_thread.run_sync(_charts_in_chromium, f"{a['api']}/dashboard#token={token}")
    assert charts["error"] == ""
    assert "steps/s:" in charts["legends"]["steps"] and "tokens/s:" in charts["legends"]["tokens"]
    assert f"budget: {history['kv_total'][-1]}" in charts["legends"]["kv"]  # 8192 tokens by default
    assert "all: 2" in charts["legends"]["peers"]
    assert (ARTIFACTS / "chat_page.png").stat().st_size > 0 and (ARTIFACTS / "dashboard_charts.png").stat().st_size
