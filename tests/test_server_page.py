"""The chat page `dflash-mlx serve` serves at `/`, in a real headless browser: Debian's
`chromium` driven through `chromium-driver` by selenium. Skipped on a machine without them
(like the Metal tests without clang); under CI=true it runs, and fails."""

import http.client
import json
import os
import shutil

import pytest
from helpers import chat_ids
from test_cli import decode_greedy
from test_generate import oracle_for
from test_server import JSON, running_server, serving

from dflash_mlx import GenerationSettings
from dflash_mlx.serve import Policy, Worker

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
NO_BROWSER = "needs chromium and chromium-driver (apt-get install chromium chromium-driver)"
pytestmark = pytest.mark.skipif(
    (CHROMIUM is None or DRIVER is None) and os.environ.get("CI") != "true", reason=NO_BROWSER
)
QUESTION = "Why is the sky blue?"
KEY = "page-test-key"
WAIT_S = 300  # for a reply: generous, the machine may be loaded
# The page as the test reads it: the last reply's state, text and pieces by source, and the
# stats bar (null before the reply's turn is on the page).
READ_PAGE = """
const turn = document.querySelector('.turn.assistant:last-of-type');
if (!turn) return null;
const spans = [...turn.querySelectorAll('.text > span')];
const stat = (id) => document.getElementById(id).textContent;
return {
  state: turn.dataset.state,
  text: turn.querySelector('.text').textContent,
  pieces: spans.map((s) => [s.textContent, s.className]),
  info: turn.querySelector('.info').textContent,
  tau: stat('tau'), tps: stat('tps'), strategy: stat('strategy'), model: stat('model'),
};
"""


@pytest.fixture(scope="module")
def browser():
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    options.add_argument("--window-size=1100,800")
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    driver.set_script_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def ask(browser, question: str, drafting: bool = True) -> dict:
    """Ask `question` on the open page in a new chat, drafting on or off; the page once the
    reply has ended (`READ_PAGE`)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.find_element(By.ID, "clear").click()
    if browser.find_element(By.ID, "draft").is_selected() != drafting:
        browser.find_element(By.ID, "draft").click()
    browser.find_element(By.ID, "prompt").send_keys(question + "\n")

    def ended(driver) -> dict | bool:
        page = driver.execute_script(READ_PAGE)
        return page if page and page["state"] != "streaming" else False

    page = WebDriverWait(browser, WAIT_S, poll_frequency=0.2).until(ended)
    assert page["state"] == "done", page
    return page


def api_reply(port: int, question: str, key: str | None = None, **body) -> dict:
    """The API's whole reply to the page's request (a user message, greedy)."""
    headers = {**JSON, **({"Authorization": f"Bearer {key}"} if key else {})}
    messages = [{"role": "user", "content": question}]
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        conn.request(
            "POST", "/v1/chat/completions", json.dumps({"messages": messages, **body}), headers
        )
        response = conn.getresponse()
        assert response.status == 200
        return json.loads(response.read())
    finally:
        conn.close()


def test_the_page_marks_accepted_drafts_and_shows_tau_live(loaded, browser, tmp_path):
    """An oracle drafter (every draft right) on a tiny random target: the page's reply is the
    API's and mlx-lm's greedy reply, pieces marked as the API marks them, with drafts among
    them; τ is the oracle's known one. Drafting off: the same text, no drafts, τ 1."""
    model, tokenizer, draft = loaded("llama-untied-mha")
    max_tokens, block_size = 40, 4
    ids = chat_ids(tokenizer, [{"role": "user", "content": QUESTION}])
    oracle, tau = oracle_for(model, tokenizer, draft, ids, max_tokens, block_size)
    settings = GenerationSettings(max_tokens=max_tokens, block_size=block_size)
    worker = Worker(model, tokenizer, oracle, settings)
    with serving(worker, Policy(api_key=KEY)) as port:
        browser.get(f"http://127.0.0.1:{port}/")  # the page itself needs no key
        key = browser.find_element("id", "key")
        assert key.is_displayed()  # the API asked for one
        key.send_keys(KEY + "\t")
        drafted = ask(browser, QUESTION)
        browser.save_screenshot(str(tmp_path / "page.png"))
        plain = ask(browser, QUESTION, drafting=False)
        whole = api_reply(port, QUESTION, KEY, max_tokens=max_tokens)
    assert drafted["model"] == "m"
    content = whole["choices"][0]["message"]["content"]
    assert drafted["text"] == content == decode_greedy(model, tokenizer, ids, max_tokens)[0]
    assert drafted["pieces"] == whole["dflash"]["sources"]
    drafts = [text for text, source in drafted["pieces"] if source == "draft"]
    assert drafts and sum(map(len, drafts)) > len(content) / 2
    assert drafted["tau"] == f"{tau:.2f}" and tau > 3
    assert float(drafted["tps"]) > 0 and "chains" in drafted["strategy"]
    assert drafted["info"].startswith(f"drafting: τ {tau:.2f}")
    assert plain["text"] == content
    assert {source for _, source in plain["pieces"]} == {"target"}
    assert plain["tau"] == "1.00" and plain["strategy"].startswith("plain")
    assert plain["info"].startswith("drafting off")


def test_dflash_mlx_serve_serves_the_page_with_its_api_key(make_pair, browser, tmp_path):
    """The real command: the page's files without the key, the API with it; the answer
    streamed on the page is the API's greedy reply, with τ and tok/s shown."""
    target, draft = make_pair("llama-tied-gqa")
    flags = ("--api-key", KEY, "--max-tokens", "24")
    with running_server(target, draft, tmp_path / "server.log", *flags) as (port, _, _):
        for path in ("/", "/page.js", "/page.css"):
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
            conn.request("GET", path)
            assert conn.getresponse().status == 200, path
            conn.close()
        browser.get(f"http://127.0.0.1:{port}/")
        browser.find_element("id", "key").send_keys(KEY + "\t")
        page = ask(browser, QUESTION)
        whole = api_reply(port, QUESTION, KEY)
    assert page["model"] == "llama-tied-gqa"
    assert page["text"] == whole["choices"][0]["message"]["content"] and page["text"]
    assert page["tau"] == f"{whole['dflash']['tau']:.2f}"
    assert float(page["tps"]) > 0 and page["strategy"] != "–"
