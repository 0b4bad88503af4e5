"""The chat page and the kept-conversations API end to end: ONE real strata-server (gunicorn, engine, SmolLM2,
--cache-disk, --api-key) for the module, restarted once on the same folder and port; the API through
`requests`, the page in Debian's Chromium (Selenium, headless), screenshots of each state under
tests/e2e/screenshots/webui/.

The tests run in file order and build on each other (one server, short generations): the page and its CSP;
the API's key, Origin and Content-Type rules; the key prompt, a streamed chat, a stop mid-stream; the
conversation listed after a reload; the API's list, paging, search, get, download; a restart, then the
conversation continued from the page with its history restored (the page shows the restored count); a rename
(same id, the title inherited by the next turn's file); the XSS cases (and no CSP violation in the console);
delete; a bad upload refused with nothing stored, a good one continued from the page; a llama.cpp slot file
uploaded, converted and continued.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import requests
import strata_sessionfile as sf
from selenium.common.exceptions import NoAlertPresentException
from selenium.webdriver.common.keys import Keys
from support.server_process import ServerProcess

from .browser import Browser, missing_browser
from .servers import E2E_CTX, HEALTHY_WITHIN_S, start_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

KEY = "page-key-1"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Over one 256-token block with the template: the store keeps (and restores) only conversations that long.
SYSTEM = "You answer in one short line. Facts: " + " ".join(
    f"Item {i} is stored in box {i * 7 % 31} on shelf {i % 5}." for i in range(30)
)
QUESTION = "Where is item 12?"
XSS_USER = (
    '<img src=x onerror="window.__xss=1"> <script>window.__xss=2</script> [open](javascript:window.__xss=3)'
)
XSS_REPLY = '<img src=y onerror="window.__xss=4"><b>bold</b> [link](javascript:window.__xss=5)'
SHORT = 6  # tokens per reply: short generations keep the module cheap
SAVED_WITHIN_S = 60.0


class Site:
    """The module's server: restartable on the same store folder and port (the page's origin stays)."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.store = tmp / "store"
        self.slots = tmp / "slots"
        self.slots.mkdir()
        self.flags = (
            "--cache-disk",
            str(self.store),
            "--cache-idle-seconds",
            "0.5",
            "--api-key",
            KEY,
            "--slot-save-path",
            str(self.slots),
        )
        self.server = start_server(tmp, *self.flags, name="webui")

    @property
    def url(self) -> str:
        return self.server.url

    def restart(self) -> None:
        port = self.server.port
        assert self.server.stop() == 0
        self.server = ServerProcess(
            "-c", E2E_CTX, *self.flags, log_path=self.tmp / "webui.log", port=port
        ).start(wait_healthy=HEALTHY_WITHIN_S)

    def get(self, path: str, **kw) -> requests.Response:
        return requests.get(self.url + path, headers={**AUTH, **kw.pop("headers", {})}, timeout=60, **kw)

    def listed(self) -> list[dict]:
        answer = self.get("/conversations", params={"limit": 200})
        assert answer.status_code == 200, answer.text
        return answer.json()["conversations"]

    def wait_listed(self, title_part: str, at_least_tokens: int = 0) -> dict:
        deadline = time.monotonic() + SAVED_WITHIN_S
        while time.monotonic() < deadline:
            for c in self.listed():
                if title_part in c["title"] and c["n_tokens"] >= at_least_tokens:
                    return c
            time.sleep(0.2)
        raise AssertionError(f"no conversation titled {title_part!r} kept within {SAVED_WITHIN_S} s")

    def files(self) -> list[str]:
        return sorted(p.name for p in self.store.iterdir() if p.is_file())


@pytest.fixture(scope="module")
def site(module_tmp):
    s = Site(module_tmp)
    yield s
    s.server.stop()


@pytest.fixture(scope="module")
def page(site, module_tmp):
    why = missing_browser()
    if why is not None:
        pytest.fail(why)
    b = Browser(module_tmp / "chromium-profile", "webui")
    yield b
    b.quit()


def reply_items(page: Browser) -> list:
    return page.css("#messages li.assistant")


def send(page: Browser, text: str) -> None:
    box = page.by_id("input")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def settings(page: Browser, *, max_tokens: int, system: str = "") -> None:
    page.js(
        "document.getElementById('system').value = arguments[0];"
        "document.getElementById('max_tokens').value = arguments[1];"
        "document.getElementById('temperature').value = 0;",
        system,
        str(max_tokens),
    )


def wait_reply_done(page: Browser, n: int) -> str:
    """The n-th reply's state once it ended: "done" or "stopped"."""
    return page.until(
        lambda: len(reply_items(page)) >= n and reply_items(page)[n - 1].get_attribute("data-done"),
        f"reply {n} to end",
    )


def open_titled(page: Browser, title_part: str) -> None:
    def clicked():
        for b in page.css("#conversations li .title"):
            if title_part in b.text:
                b.click()  # inside the wait: a list drawn again meanwhile is looked up again
                return True
        page.js("document.getElementById('search').dispatchEvent(new Event('input'))")  # list again
        return False

    page.until(clicked, f"{title_part!r} in the list", timeout=SAVED_WITHIN_S)
    page.until(lambda: page.css("#messages li.user"), "the conversation to open")


def click_in_item(page: Browser, conversation_id: str, selector: str) -> None:
    def clicked():
        for li in page.css("#conversations li"):
            if li.get_attribute("data-id") == conversation_id:
                li.find_element("css selector", selector).click()
                return True
        return False

    page.until(clicked, f"{selector} of {conversation_id} in the list")


# --- the page and the API's rules --------------------------------------------------------------


def test_page_is_served_with_a_strict_csp(site):
    answer = requests.get(site.url + "/", timeout=30)  # no key: the page asks for it
    assert answer.status_code == 200
    csp = answer.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe-inline" not in csp
    html = answer.text
    scripts = re.findall(r"<script\b[^>]*>", html)
    assert scripts and all(re.search(r'src="/webui/[\w.]+"', s) for s in scripts)
    assert not re.search(r"\son\w+\s*=", html), "no inline event handlers"
    assert not re.search(r"(src|href)=\"(https?:)?//", html), "nothing from another origin"
    js = requests.get(site.url + "/webui/app.js", timeout=30)
    assert js.status_code == 200 and js.headers["Content-Type"].startswith("text/javascript")
    assert "innerHTML" not in js.text and "eval(" not in js.text


def test_conversations_api_rules(site):
    assert requests.get(site.url + "/conversations", timeout=30).status_code == 401
    foreign = site.get("/conversations", headers={"Origin": "http://evil.example"})
    assert foreign.status_code == 403 and "Origin" in foreign.json()["error"]["message"]
    wrong_type = requests.post(
        site.url + "/conversations",
        data=b"{}",
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=30,
    )
    assert wrong_type.status_code == 415
    assert site.get("/conversations/" + "0" * 32).status_code == 404
    bad_id = site.get("/conversations/..%2Fetc")
    assert bad_id.status_code in (400, 404)
    assert site.get("/conversations", params={"limit": 0}).status_code == 400


# --- the page ----------------------------------------------------------------------------------


def test_key_prompt_then_a_streamed_chat(site, page):
    page.driver.get(site.url + "/")
    page.until(lambda: page.by_id("key-dialog").get_attribute("open") is not None, "the API-key prompt")
    page.shot("key-prompt")
    page.by_id("key-input").send_keys("wrong-key" + Keys.ENTER)
    page.until(lambda: "refused" in page.by_id("key-error").text, "the wrong key refused")
    page.by_id("key-input").clear()
    page.by_id("key-input").send_keys(KEY + Keys.ENTER)
    page.until(lambda: "context 2048" in page.by_id("model").text, "the model's name and context from /props")
    assert page.js("return localStorage.getItem('strata.apiKey')") == KEY
    settings(page, max_tokens=SHORT, system=SYSTEM)
    # Count the reply's renders: a streamed reply is drawn more than once.
    page.js(
        "window.__renders = 0; new MutationObserver(() => window.__renders++)"
        ".observe(document.getElementById('messages'), {childList: true, subtree: true});"
        # The return_progress bar's text as it was drawn (it hides again at the first token).
        "window.__progress = ''; new MutationObserver((records) => { for (const r of records)"
        " for (const n of r.addedNodes) if (n.nodeType === 3) window.__progress = n.data; })"
        ".observe(document.getElementById('progress-text'), {childList: true});"
    )
    send(page, QUESTION)
    assert wait_reply_done(page, 1) == "done"
    reply = reply_items(page)[0]
    assert reply.find_element("css selector", ".body").text.strip()
    assert "tokens restored or reused" in reply.find_element("css selector", ".stats").text
    assert page.js("return window.__renders") >= 3
    assert re.fullmatch(
        r"prompt \d+ / \d+ tokens \(\d+ restored or reused\)", page.js("return window.__progress")
    )
    page.shot("streamed-reply")


def test_stop_mid_stream(site, page):
    page.by_id("new-chat").click()
    settings(page, max_tokens=400)
    send(page, "Write a long story about a lighthouse keeper and his cat, with many chapters.")
    page.until(
        lambda: (
            reply_items(page) and len(reply_items(page)[-1].find_element("css selector", ".body").text) > 8
        ),
        "the reply to begin",
    )
    page.by_id("input").send_keys(Keys.ESCAPE)
    assert wait_reply_done(page, 1) == "stopped"
    page.shot("stopped")
    assert page.by_id("stop").get_attribute("hidden") is not None
    assert requests.get(site.url + "/health", timeout=30).status_code == 200


def test_reload_lists_the_conversation(site, page):
    site.wait_listed(QUESTION)
    page.driver.refresh()
    page.until(
        lambda: any(QUESTION in b.text for b in page.css("#conversations li .title")),
        "the chat after a reload",
    )
    assert page.by_id("key-dialog").get_attribute("open") is None, "the key is kept in the browser"
    page.shot("listed-after-reload")


def test_keyboard_narrow_window_and_dark_mode(site, page):
    box = page.by_id("input")
    box.send_keys("first line", Keys.SHIFT, Keys.ENTER, Keys.SHIFT, "second line")
    assert box.get_attribute("value") == "first line\nsecond line" and not page.css("#messages li")
    box.clear()
    page.driver.execute_cdp_cmd(
        "Emulation.setEmulatedMedia", {"features": [{"name": "prefers-color-scheme", "value": "dark"}]}
    )
    page.driver.set_window_size(420, 800)
    try:
        background = page.js("return getComputedStyle(document.body).backgroundColor")
        assert sum(int(v) for v in re.findall(r"\d+", background)[:3]) < 3 * 64, background
        assert page.by_id("toggle-list").is_displayed()
        width = page.js("return document.documentElement.scrollWidth")
        assert width <= 420, f"the page is {width} px wide in a 420 px window"
        page.shot("narrow-dark")
        violations = [m for m in page.console() if "Content Security Policy" in m]
        assert not violations, violations
    finally:
        page.driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": []})
        page.driver.set_window_size(1200, 900)


# --- the API -----------------------------------------------------------------------------------


def test_api_list_get_page_search_download(site):
    kept = site.wait_listed(QUESTION)
    assert re.fullmatch(r"[0-9a-f]{32}", kept["id"])
    assert kept["n_tokens"] > 256 and kept["n_bytes"] > kept["n_tokens"] * 20_000
    assert "disk" in kept["where"] and kept["n_messages"] == 3 and kept["text_from"] == "notes"
    one = site.get(f"/conversations/{kept['id']}").json()
    assert [m["role"] for m in one["messages"]] == ["system", "user", "assistant"]
    assert one["messages"][0]["content"] == SYSTEM and one["messages"][1]["content"] == QUESTION
    assert QUESTION in one["text"]
    total = len(site.listed())
    first = site.get("/conversations", params={"limit": 1, "offset": 0}).json()
    assert first["total"] == total and len(first["conversations"]) == 1
    found = site.get("/conversations", params={"q": "ITEM 12"}).json()
    assert [c["id"] for c in found["conversations"]] == [kept["id"]]
    assert site.get("/conversations", params={"q": "no such title"}).json()["total"] == 0
    file = site.get(f"/conversations/{kept['id']}/file")
    assert file.status_code == 200 and file.headers["Content-Type"] == "application/octet-stream"
    assert file.content == (site.store / f"{kept['id']}.ssf").read_bytes()


# --- restart, continue -------------------------------------------------------------------------


def test_restart_then_continue_with_history_restored(site, page):
    kept = site.wait_listed(QUESTION)
    site.restart()
    assert any(c["id"] == kept["id"] for c in site.listed()), "the same id after a restart"
    page.driver.get(site.url + "/")
    open_titled(page, QUESTION)
    assert [li.get_attribute("class") for li in page.css("#messages li")] == ["system", "user", "assistant"]
    page.shot("opened-after-restart")
    settings(page, max_tokens=SHORT)
    send(page, "And item 3?")
    assert wait_reply_done(page, 2) == "done"
    stats = reply_items(page)[-1].find_element("css selector", ".stats").text
    restored = int(re.search(r"(\d+) tokens restored or reused", stats).group(1))
    # The history came from the file, not evaluated again (the reply's last tokens may tokenize otherwise).
    assert restored >= kept["n_tokens"] - SHORT, stats
    page.shot("continued-restored")
    site.continued = site.wait_listed(QUESTION, at_least_tokens=kept["n_tokens"] + 3)


def test_rename_from_the_page_keeps_the_id_and_survives_the_next_turn(site, page):
    kept = site.continued
    page.driver.get(site.url + "/")
    click_in_item(page, kept["id"], "button.rename")
    alert = page.until(lambda: _alert(page), "the rename prompt")
    alert.send_keys("Boxes & shelves")
    alert.accept()
    page.until(
        lambda: any(b.text == "Boxes & shelves" for b in page.css("#conversations li .title")),
        "the new title",
    )
    page.shot("renamed")
    renamed = site.get(f"/conversations/{kept['id']}").json()
    assert renamed["title"] == "Boxes & shelves" and renamed["id"] == kept["id"]
    assert renamed["messages"] == site.get(f"/conversations/{kept['id']}").json()["messages"]
    assert sf.inspect(site.store / f"{kept['id']}.ssf", verify=True).payload_verified
    bad = requests.patch(
        site.url + f"/conversations/{kept['id']}",
        data="{}",
        headers={**AUTH, "Content-Type": "text/plain"},
        timeout=30,
    )
    assert bad.status_code == 415
    # The next turn (restored from the renamed file) is saved under a new id with the title carried.
    page.by_id("new-chat").click()
    open_titled(page, "Boxes & shelves")
    settings(page, max_tokens=SHORT)
    send(page, "And item 4?")
    assert wait_reply_done(page, len(page.css("#messages li.user"))) == "done"
    site.renamed = site.wait_listed("Boxes & shelves", at_least_tokens=kept["n_tokens"] + 5)
    assert site.renamed["id"] != kept["id"]


def _alert(page: Browser):
    try:
        return page.driver.switch_to.alert
    except NoAlertPresentException:
        return None


# --- XSS -----------------------------------------------------------------------------------------


def test_markup_in_titles_messages_and_replies_does_nothing(site, page):
    # A stored conversation whose user message and assistant reply hold markup and a javascript: link.
    answer = requests.post(
        site.url + "/v1/chat/completions",
        headers=AUTH,
        json={
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": XSS_USER},
                {"role": "assistant", "content": XSS_REPLY},
                {"role": "user", "content": "ok"},
            ],
            "max_tokens": 1,
            "temperature": 0,
        },
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    site.wait_listed("<img src=x")
    page.driver.get(site.url + "/")
    open_titled(page, "<img src=x")
    page.shot("xss-rendered-as-text")
    texts = [b.text for b in page.css("#messages li .body")]
    assert XSS_USER in texts and any(t.startswith(XSS_REPLY) for t in texts)
    assert page.js("return window.__xss === undefined")
    assert not page.css("#messages img, #messages script, #messages b, #messages a")
    assert not page.css("#conversations img, #conversations script, #conversations a")
    assert not [m for m in page.console() if "Content Security Policy" in m]


# --- delete, upload ------------------------------------------------------------------------------


def test_delete_from_the_page(site, page):
    kept = site.wait_listed("Boxes & shelves", at_least_tokens=site.renamed["n_tokens"])
    page.driver.get(site.url + "/")
    site.saved_file = site.get(f"/conversations/{kept['id']}/file").content  # for the upload below
    click_in_item(page, kept["id"], "button.delete")
    page.until(lambda: _accept_alert(page), "the delete confirmation")
    page.until(
        lambda: all(li.get_attribute("data-id") != kept["id"] for li in page.css("#conversations li")),
        "the conversation gone from the list",
    )
    page.shot("deleted")
    assert site.get(f"/conversations/{kept['id']}").status_code == 404
    assert f"{kept['id']}.ssf" not in site.files()


def _accept_alert(page: Browser) -> bool:
    try:
        page.driver.switch_to.alert.accept()
        return True
    except NoAlertPresentException:
        return False


def test_bad_upload_is_refused_and_nothing_stored(site):
    before = site.files()
    for body, reason in ((b"not a session file" * 100, None), (site.saved_file[:-100], None), (b"", "empty")):
        answer = requests.post(
            site.url + "/conversations",
            data=body,
            headers={**AUTH, "Content-Type": "application/octet-stream"},
            timeout=60,
        )
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["reason"] == reason or reason is None
        assert "reason" in answer.json()["error"]
    assert site.files() == before


def test_upload_from_the_page_then_continue(site, page, module_tmp):
    upload = module_tmp / "kept.ssf"
    upload.write_bytes(site.saved_file)
    page.driver.get(site.url + "/")
    page.until(lambda: page.by_id("list-note").text, "the list")
    page.by_id("upload").send_keys(str(upload))
    page.until(lambda: page.by_id("status").text == "Uploaded.", "the upload")
    page.until(lambda: page.css("#messages li.assistant"), "the uploaded conversation opened")
    page.shot("uploaded")
    settings(page, max_tokens=SHORT)
    send(page, "Thanks.")
    n = len(reply_items(page))
    assert wait_reply_done(page, n) == "done"
    stats = reply_items(page)[-1].find_element("css selector", ".stats").text
    assert int(re.search(r"(\d+) tokens restored or reused", stats).group(1)) > 256, stats
    page.shot("uploaded-continued")


def test_a_llama_cpp_slot_file_uploaded_is_converted_and_continued(site):
    saved = requests.post(
        site.url + "/slots/0?action=save",
        headers=AUTH,
        json={"filename": "chat.bin", "format": "llama.cpp"},
        timeout=120,
    )
    assert saved.status_code == 200, saved.text
    n_saved = saved.json()["n_saved"]
    held = site.wait_listed("Boxes & shelves", at_least_tokens=n_saved)
    gone = requests.delete(site.url + f"/conversations/{held['id']}", headers=AUTH, timeout=60)
    assert gone.status_code == 200, gone.text  # the slot holding it is erased too
    upload = requests.post(
        site.url + "/conversations",
        data=(site.slots / "chat.bin").read_bytes(),
        headers={**AUTH, "Content-Type": "application/octet-stream"},
        timeout=120,
    )
    assert upload.status_code == 201, upload.text
    kept = upload.json()
    assert kept["n_tokens"] == n_saved and kept["text_from"] == "tokens" and kept["n_messages"] >= 5
    messages = site.get(f"/conversations/{kept['id']}").json()["messages"]
    reply = requests.post(
        site.url + "/v1/chat/completions",
        headers=AUTH,
        json={
            "messages": [*messages, {"role": "user", "content": "Bye."}],
            "max_tokens": SHORT,
            "temperature": 0,
        },
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= n_saved - SHORT
