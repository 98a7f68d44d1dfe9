"""The demo chat page and the operator dashboard, driven in a real headless Chromium.

Run by the Rust integration test `pages::demo_page_and_dashboard_work_in_a_browser`, which
starts `spendgate demo` and passes, in the environment:
  SPENDGATE_BASE      http://127.0.0.1:PORT of the demo gateway
  SPENDGATE_ADMIN     its admin token (printed by `spendgate demo`)
  SPENDGATE_MOCK      http://127.0.0.1:PORT of its built-in mock upstream
  SPENDGATE_CHROMIUM  the browser binary; SPENDGATE_CHROMEDRIVER its driver

Checks, in order:
  1. /demo/ creates a guest session (cookie only), a non-streamed message gets the mock's
     answer, and the page shows what was reserved and charged (committed);
  2. a streamed message arrives and is reconciled;
  3. the mock (the ground truth) served exactly those two calls;
  4. /admin/ with the admin token shows the service's spend (global used > 0) and the ledger,
     its inline script and style running under its Content-Security-Policy (nothing refused);
  5. "Engage cutoff" from the dashboard makes the next chat message fail with 503
     `cutoff_engaged`, and the mock serves nothing more; "Release cutoff" lets chat resume.
Prints "N passed, 0 failed" at the end; any failure raises.
"""

import json
import os
import sys
import time
import urllib.request

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

BASE = os.environ["SPENDGATE_BASE"]
ADMIN = os.environ["SPENDGATE_ADMIN"]
MOCK = os.environ["SPENDGATE_MOCK"]
ARTIFACTS = os.environ.get("SPENDGATE_ARTIFACTS", "")
WAIT_S = 20

passed = 0


def ok(name):
    global passed
    passed += 1
    print(f"ok: {name}", flush=True)


def shot(name):
    if ARTIFACTS:
        os.makedirs(ARTIFACTS, exist_ok=True)
        _DRIVER[0].save_screenshot(os.path.join(ARTIFACTS, name + ".png"))


def alert_present(d):
    try:
        d.switch_to.alert
        return True
    except Exception:
        return False


_DRIVER = [None]


def mock_requests():
    with urllib.request.urlopen(MOCK + "/mock/stats", timeout=5) as r:
        return json.load(r)["requests"]


def browser():
    opts = Options()
    opts.binary_location = os.environ["SPENDGATE_CHROMIUM"]
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--no-first-run", "--window-size=1200,900"):
        opts.add_argument(a)
    # The console, to see what a page's Content-Security-Policy refused.
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(os.environ["SPENDGATE_CHROMEDRIVER"]), options=opts)


def messages(d, kind):
    return d.find_elements(By.CSS_SELECTOR, f"#log .msg.{kind}")


def chat(d, text, kind, count):
    """Sends `text` and waits until there are `count` messages of `kind` whose meta (or, for
    errors, body) is filled in; returns the last one's (body, meta) text."""
    box = d.find_element(By.ID, "input")
    box.clear()
    box.send_keys(text)
    d.find_element(By.ID, "send").click()

    def done(_):
        ms = messages(d, kind)
        if len(ms) < count:
            return False
        last = ms[count - 1]
        body = last.find_element(By.CSS_SELECTOR, ".body").text
        meta = last.find_element(By.CSS_SELECTOR, ".meta").text
        # The send button comes back when the page has finished with the answer.
        if not d.find_element(By.ID, "send").is_enabled():
            return False
        return (body, meta) if (body and (meta or kind == "error")) else False

    return WebDriverWait(d, WAIT_S).until(done)


def main():
    d = browser()
    _DRIVER[0] = d
    try:
        d.get(BASE + "/demo/")
        WebDriverWait(d, WAIT_S).until(
            lambda d: len(Select(d.find_element(By.ID, "model")).options) > 0)
        WebDriverWait(d, WAIT_S).until(
            lambda d: any(c["name"] == "spendgate_session" for c in d.get_cookies()))
        cookie = next(c for c in d.get_cookies() if c["name"] == "spendgate_session")
        assert cookie["httpOnly"], cookie
        ok("the demo page loads its models and gets a guest session cookie (HttpOnly)")

        before = mock_requests()
        stream = d.find_element(By.ID, "stream")
        if stream.is_selected():
            stream.click()
        body, meta = chat(d, "Hello from a real browser", "assistant", 1)
        assert "tok" in body, body
        assert "reserved" in meta and "charged" in meta and "committed" in meta, meta
        ok(f"a message is answered and reconciled: {meta}")

        d.find_element(By.ID, "stream").click()
        body, meta = chat(d, "And now streamed", "assistant", 2)
        assert "tok" in body, body
        assert "charged at that usage" in meta, meta
        ok(f"a streamed message arrives and is reconciled: {meta}")

        assert mock_requests() - before == 2, (before, mock_requests())
        ok("the mock upstream served exactly the two calls")

        d.get(BASE + "/admin/")
        d.find_element(By.ID, "token").send_keys(ADMIN)
        d.find_element(By.ID, "load").click()
        WebDriverWait(d, WAIT_S).until(
            lambda d: d.find_element(By.ID, "status").text.startswith("loaded"))
        summary = d.find_element(By.ID, "summary").text
        assert "ledger seq" in summary and "cutoff off" in summary, summary
        used = d.find_elements(By.CSS_SELECTOR, "#summary table tr td:nth-child(3)")
        assert used and any(float(u.text) > 0 for u in used), summary
        assert d.find_elements(By.CSS_SELECTOR, "#scopes table tr td"), "no scopes listed"
        ok("the dashboard shows the global spend and the ledger")

        collapse = d.execute_script(
            "return getComputedStyle(document.querySelector('#summary table')).borderCollapse")
        refused = [e["message"] for e in d.get_log("browser")
                   if "Content Security Policy" in e["message"]]
        assert collapse == "collapse" and not refused, (collapse, refused)
        ok("the dashboard's script and style run under its Content-Security-Policy")

        WebDriverWait(d, WAIT_S).until(
            lambda d: d.find_elements(By.CSS_SELECTOR, "#spend svg path.series"))
        assert d.find_elements(By.CSS_SELECTOR, "#spend svg line.limit"), "no limit line"
        tops = d.find_elements(By.CSS_SELECTOR, "#tops table")
        assert len(tops) == 4 and all(t.find_elements(By.CSS_SELECTOR, "td") for t in tops), \
            d.find_element(By.ID, "tops").text
        # The forecast needs the burn rate's samples (the alert checker reads the global
        # budgets every second): reload until the summary carries them.
        WebDriverWait(d, WAIT_S).until(
            lambda d: d.find_element(By.ID, "load").click()
            or d.find_element(By.ID, "forecast").text.startswith("forecast:"))
        forecast = d.find_element(By.ID, "forecast").text
        assert "spent at the reset" in forecast, forecast
        shot("dashboard-today")
        ok(f"the dashboard draws the spend chart with its limit line, the forecast and the "
           f"top spenders ({forecast})")

        loaded = d.find_element(By.ID, "status").text
        time.sleep(0.01)
        Select(d.find_element(By.ID, "period")).select_by_value("1")
        WebDriverWait(d, WAIT_S).until(
            lambda d: d.find_element(By.ID, "status").text != loaded
            and d.find_elements(By.CSS_SELECTOR, "#spend svg path.series"))
        shot("dashboard-last-hour")
        ok("a period is picked and the charts follow")

        d.find_element(By.ID, "reason").send_keys("page test")
        d.find_element(By.ID, "engage").click()
        WebDriverWait(d, WAIT_S).until(lambda d: alert_present(d))
        d.switch_to.alert.accept()
        WebDriverWait(d, WAIT_S).until(
            lambda d: "ENGAGED: page test" in d.find_element(By.ID, "summary").text)
        shot("dashboard-cutoff")
        ok("the dashboard engages the cutoff")

        d.get(BASE + "/demo/")
        WebDriverWait(d, WAIT_S).until(
            lambda d: len(Select(d.find_element(By.ID, "model")).options) > 0)
        before = mock_requests()
        body, _ = chat(d, "Anyone there?", "error", 1)
        assert "503" in body and "cutoff_engaged" in body, body
        time.sleep(0.2)
        assert mock_requests() == before, "the upstream was called under the cutoff"
        ok(f"under the cutoff chat is refused and nothing is forwarded: {body}")

        d.get(BASE + "/admin/")
        d.find_element(By.ID, "token").send_keys(ADMIN)
        d.find_element(By.ID, "release").click()
        WebDriverWait(d, WAIT_S).until(
            lambda d: "cutoff off" in d.find_element(By.ID, "summary").text)
        d.get(BASE + "/demo/")
        WebDriverWait(d, WAIT_S).until(
            lambda d: len(Select(d.find_element(By.ID, "model")).options) > 0)
        body, meta = chat(d, "Back again", "assistant", 1)
        assert "tok" in body and "charged" in meta, (body, meta)
        ok("after the release chat resumes")
    finally:
        d.quit()
    print(f"{passed} passed, 0 failed", flush=True)


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # the Rust test shows this output
        print(f"FAILED: {type(e).__name__}: {e}", flush=True)
        sys.exit(1)
