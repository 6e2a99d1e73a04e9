"""The admin console in a real headless Chromium (Debian's ``chromium`` + ``chromium-driver``,
driven by selenium) against a real ``portico serve`` with a tiny real engine: sign in, create a
tenant, create a key (its secret shown once), rotate it, revoke it, edit and disable the tenant,
read usage, and visit every page with
no Content-Security-Policy violation and a label on every field.

Screenshots of each page go to the test's tmp folder; with ``PORTICO_UPDATE_SCREENSHOTS=1``
they are also written to ``docs/img/`` (shown in docs/operations.md).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from tests.gateway.dataplane.harness import (
    ADMIN_KEY,
    REPO_ROOT,
    GatewayProcess,
    tiny_engine,
    wait_until,
)
from tests.gateway.tracing.otlp_receiver import OTLPReceiver

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
if (CHROMIUM is None or CHROMEDRIVER is None) and not os.environ.get("CI"):
    pytest.skip("chromium and chromium-driver are not installed", allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.common.exceptions import (  # noqa: E402
    NoSuchElementException,
    StaleElementReferenceException,
)
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support import expected_conditions as ec  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

DOCS_IMG = REPO_ROOT / "docs" / "img"


@pytest.fixture(scope="module")
def receiver() -> Iterator[OTLPReceiver]:
    r = OTLPReceiver()
    r.start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path, receiver: OTLPReceiver
) -> Iterator[GatewayProcess]:
    """``portico serve`` with a tiny real engine, both exporting traces to ``receiver`` (one
    real-engine gateway serves this module's console, engines and cross-process trace tests)."""
    gw = GatewayProcess(
        tmp_path_factory.mktemp("console-browser"),
        {"engines": [tiny_engine(tiny_llama_dir)]},
        routing={},
    )
    with pytest.MonkeyPatch.context() as env:  # the gateway and its engine inherit these
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
        gw.start(timeout=300)
    yield gw
    gw.terminate()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    profile = tempfile.mkdtemp(prefix="portico-chromium-")
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--window-size=1280,900",
        f"--user-data-dir={profile}",
    ):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    service = webdriver.ChromeService(executable_path=str(CHROMEDRIVER))
    driver = webdriver.Chrome(options=options, service=service)
    driver.implicitly_wait(0)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


class Console:
    """The console page in the browser, with waits that read like the steps."""

    def __init__(self, driver: Any, base_url: str, shots: Path) -> None:
        self.driver = driver
        self.base_url = base_url
        self.shots = shots
        # The page re-renders its tables after each change: a node found a moment ago may be
        # gone when read, so a wait retries on a stale element as on a missing one.
        self.wait = WebDriverWait(
            driver, 60, ignored_exceptions=(NoSuchElementException, StaleElementReferenceException)
        )

    def heading(self, text: str) -> None:
        self.wait.until(ec.text_to_be_present_in_element((By.CSS_SELECTOR, "main h1"), text))

    def visible(self, css: str) -> Any:
        return self.wait.until(ec.visibility_of_element_located((By.CSS_SELECTOR, css)))

    def go(self, hash_: str, heading: str) -> None:
        self.driver.get(f"{self.base_url}/admin/ui#{hash_}")
        self.heading(heading)

    def status(self, text: str) -> None:
        self.wait.until(ec.text_to_be_present_in_element((By.ID, "status"), text))

    def shot(self, name: str) -> None:
        path = self.shots / f"console-{name}.png"
        self.driver.save_screenshot(str(path))
        if os.environ.get("PORTICO_UPDATE_SCREENSHOTS") == "1":
            DOCS_IMG.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, DOCS_IMG / path.name)

    def every_field_is_labelled(self) -> None:
        unlabelled = self.driver.execute_script(
            "return [...document.querySelectorAll('input, select')]"
            ".filter(e => e.labels.length === 0).map(e => e.id || e.name);"
        )
        assert unlabelled == []

    def csp_violations(self) -> list[str]:
        logs = self.driver.get_log("browser")
        return [e["message"] for e in logs if "Content Security Policy" in e["message"]]


def test_console_end_to_end(gateway: GatewayProcess, browser: Any, tmp_path: Path) -> None:
    # Some traffic first, so the usage page has something to draw.
    traffic_tenant, secret = gateway.create_tenant()
    client = OpenAI(base_url=gateway.base_url + "/v1", api_key=secret)
    for _ in range(2):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    c = Console(browser, gateway.base_url, tmp_path)
    _sign_in(c, browser, gateway)
    _create_tenant(c, browser)
    _create_rotate_and_revoke_a_key(c, browser, gateway)
    _edit_and_disable_the_tenant(c, browser)
    _usage_and_engine_pages(c, browser, traffic_tenant)
    _audit_log(c, browser)
    _keyboard_and_sign_out(c, browser, gateway)


def _sign_in(c: Console, browser: Any, gateway: GatewayProcess) -> None:
    # Sign in (keyboard only: type the key, press Enter).
    browser.get(gateway.base_url + "/admin/ui")
    c.heading("Sign in")
    c.every_field_is_labelled()
    c.shot("signin")
    field = c.visible("#credential")
    assert browser.switch_to.active_element == field  # focus starts in the field
    field.send_keys(ADMIN_KEY, Keys.ENTER)
    c.heading("Tenants")
    assert "Signed in as admin-" in c.visible("#who").text
    cookies = {k["name"]: k for k in browser.get_cookies()}
    assert cookies["portico_console"]["httpOnly"] is True
    assert cookies["portico_console"]["sameSite"] == "Strict"
    assert browser.execute_script("return document.cookie") == ""  # invisible to scripts


def _create_tenant(c: Console, browser: Any) -> None:
    # Create a tenant.
    c.visible("#new-tenant-id").send_keys("browser-co")
    browser.find_element(By.ID, "new-tenant-name").send_keys("Browser Co")
    Select(browser.find_element(By.ID, "new-tenant-plan")).select_by_value("standard")
    browser.find_element(By.CSS_SELECTOR, "form[aria-label='Create a tenant'] button").click()
    c.status("Tenant browser-co created.")
    c.wait.until(ec.text_to_be_present_in_element((By.CSS_SELECTOR, "main table"), "browser-co"))
    c.every_field_is_labelled()
    c.shot("tenants")


def _create_rotate_and_revoke_a_key(c: Console, browser: Any, gateway: GatewayProcess) -> None:
    # Create a key: the secret is shown once.
    c.go("keys/browser-co", "Keys of browser-co")
    c.visible("#new-key-name").send_keys("ci")
    browser.find_element(By.CSS_SELECTOR, "form[aria-label='Create a key'] button").click()
    shown = c.visible("#new-secret").text
    assert shown.startswith("sk-") and len(shown) > 40
    row = c.visible("main tbody tr")
    assert "active" in row.text and shown not in row.text  # the table shows sk-...xxxx only
    c.every_field_is_labelled()
    c.shot("keys")
    # The key works; rotating it with no grace shows a new secret and ends the old one.
    OpenAI(base_url=gateway.base_url + "/v1", api_key=shown).models.list()
    browser.find_element(By.CSS_SELECTOR, "button[aria-label^='Rotate key']").click()
    grace = c.visible("#grace")
    grace.clear()
    grace.send_keys("0", Keys.ENTER)
    c.wait.until(lambda d: d.find_element(By.ID, "new-secret").text not in ("", shown))
    rotated = browser.find_element(By.ID, "new-secret").text
    assert rotated.startswith("sk-")
    assert wait_until(lambda: _refused(gateway, shown), timeout=10)
    OpenAI(base_url=gateway.base_url + "/v1", api_key=rotated).models.list()
    # Revoke the new key: it stops working too.
    browser.find_element(By.CSS_SELECTOR, "button[aria-label^='Revoke key']").click()
    c.status("revoked")
    c.wait.until(lambda d: not d.find_elements(By.CSS_SELECTOR, "button[aria-label^='Revoke key']"))
    assert wait_until(lambda: _refused(gateway, rotated), timeout=10)


def _edit_and_disable_the_tenant(c: Console, browser: Any) -> None:
    # Edit the tenant's plan overrides, then disable it.
    c.go("tenants", "Tenants")
    browser.find_element(By.CSS_SELECTOR, "button[aria-label='Edit tenant browser-co']").click()
    rpm = c.visible("#edit-requests_per_minute")
    rpm.send_keys("7")
    browser.find_element(
        By.CSS_SELECTOR, "form[aria-label='Edit tenant browser-co'] button"
    ).click()
    c.status("Tenant browser-co saved.")
    row = "//tr[td[1][text()='browser-co']]"
    c.wait.until(lambda d: d.find_element(By.XPATH, row + "/td[5]").text == "7")
    browser.find_element(By.CSS_SELECTOR, "button[aria-label='Disable tenant browser-co']").click()
    c.status("Tenant browser-co disabled.")
    c.wait.until(lambda d: "disabled" in d.find_element(By.XPATH, row).text)


def _usage_and_engine_pages(c: Console, browser: Any, traffic_tenant: str) -> None:
    # Usage of the tenant that had traffic: a chart and the per-model table.
    c.go(f"usage/{traffic_tenant}", f"Usage of {traffic_tenant}")
    c.wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "svg.chart rect.s0"))
    assert "2 requests" in c.visible("main p").text
    assert "$0.000000 spent" in c.visible("main p").text  # the tiny model has no price
    assert "Spend (USD)" in browser.find_element(By.CSS_SELECTOR, "main table thead").text
    c.shot("usage")

    # Engines: the tiny engine, ready, with its KV cache meter.
    c.go("engines", "Engines")
    c.wait.until(ec.text_to_be_present_in_element((By.CSS_SELECTOR, "main tbody"), "ready"))
    assert "tiny-0" in browser.find_element(By.CSS_SELECTOR, "main tbody").text
    # the tenants table: the tenant that had traffic, as the engine's scheduler counted it
    tenants = "//table[caption[starts-with(text(), 'Per tenant and replica')]]"
    row = c.wait.until(
        lambda d: d.find_element(By.XPATH, f"{tenants}//tr[td[2][text()='{traffic_tenant}']]")
    )
    assert row.find_element(By.XPATH, "td[1]").text == "tiny-0"
    header = browser.find_element(By.XPATH, f"{tenants}//thead").text
    assert "Running slots" in header and "Slot share" in header
    c.shot("engines")

    c.go("adapters", "LoRA adapters")
    c.every_field_is_labelled()
    c.shot("adapters")


def _audit_log(c: Console, browser: Any) -> None:
    # The audit log shows what the console did, newest first.
    c.go("audit", "Audit log")
    body = c.visible("main tbody")
    c.wait.until(lambda d: "key.revoke" in d.find_element(By.CSS_SELECTOR, "main tbody").text)
    text = body.text
    order = ["tenant.update", "key.revoke", "key.rotate", "key.create", "tenant.create"]
    assert [text.index(a) for a in order] == sorted(text.index(a) for a in order)
    assert "tenant.create" in body.text and "console.sign_in" in body.text
    assert "null" not in c.visible("main").text
    browser.find_element(By.CSS_SELECTOR, "main tbody tr details summary").click()  # before/after
    assert '"disabled": true' in c.visible("main tbody tr details").text  # the newest change
    c.shot("audit")


def _keyboard_and_sign_out(c: Console, browser: Any, gateway: GatewayProcess) -> None:
    # Keyboard: Tab from the top (the skip link) reaches the navigation and the page's controls.
    browser.execute_script("document.querySelector('a.skip').focus()")
    reached = []
    for _ in range(12):
        active = browser.switch_to.active_element
        reached.append(active.get_attribute("id") or active.text)
        active.send_keys(Keys.TAB)
    assert "Tenants" in reached and "flt-action" in reached

    assert c.csp_violations() == []

    # Sign out: back to the sign-in form, and the session no longer works.
    browser.find_element(By.ID, "sign-out").click()
    c.heading("Sign in")
    browser.get(gateway.base_url + "/admin/ui#tenants")
    c.heading("Sign in")


def _refused(gateway: GatewayProcess, secret: str) -> bool:
    import httpx

    resp = httpx.get(gateway.base_url + "/v1/models", headers={"authorization": f"Bearer {secret}"})
    return resp.status_code == 401


def test_engines_api_reports_the_engines_own_gauges(gateway: GatewayProcess) -> None:
    """``GET /admin/v1/engines`` (the engines page's data) over the real engine's /metrics."""
    import httpx

    resp = httpx.get(
        gateway.base_url + "/admin/v1/engines", headers={"authorization": f"Bearer {ADMIN_KEY}"}
    )
    assert resp.status_code == 200, resp.text
    (engine,) = resp.json()["data"]
    assert (engine["name"], engine["model"], engine["state"], engine["up"]) == (
        "tiny-0", "tiny", "ready", True
    )  # fmt: skip
    assert engine["restarts"] == 0 and isinstance(engine["pid"], int)
    gauges = engine["metrics"]
    assert set(gauges) == {"running", "waiting", "kv_cache_usage", "preemptions"}
    assert 0.0 <= gauges["kv_cache_usage"] <= 1.0 and gauges["waiting"] >= 0
    assert httpx.get(gateway.base_url + "/admin/v1/engines").status_code == 401


def test_one_trace_across_the_gateway_and_engine_processes(
    gateway: GatewayProcess, receiver: OTLPReceiver
) -> None:
    """The gateway's upstream attempt is the parent of the engine's span: ``traceparent``
    crossed the engine socket; the engine's ``queue`` and ``execute`` are its children."""
    _, secret = gateway.create_tenant()
    client = OpenAI(base_url=gateway.base_url + "/v1", api_key=secret)
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        stream=True,
        extra_headers={"x-request-id": "trace-e2e-1"},
    )
    assert list(stream)

    def spans_of_request() -> dict[tuple[str, str], Any]:
        found: dict[tuple[str, str], Any] = {}
        ours = {
            s.span_id
            for _, s in receiver.spans()
            if receiver.attributes(s).get("portico.request_id") == "trace-e2e-1"
        }
        for service, span in receiver.spans():
            if span.span_id in ours or span.parent_span_id in ours:
                found[(service, span.name)] = span
        return found

    want = {
        ("portico-gateway", "chat tiny"),
        ("portico-gateway", "upstream attempt"),
        ("portico-gateway", "stream"),
        ("portico-engine", "engine /v1/chat/completions"),
        ("portico-engine", "queue"),
        ("portico-engine", "execute"),
    }
    assert wait_until(lambda: want <= set(spans_of_request()), timeout=30), spans_of_request()
    spans = spans_of_request()
    root = spans[("portico-gateway", "chat tiny")]
    attempt = spans[("portico-gateway", "upstream attempt")]
    served = spans[("portico-engine", "engine /v1/chat/completions")]
    assert served.trace_id == attempt.trace_id == root.trace_id
    assert attempt.parent_span_id == root.span_id and served.parent_span_id == attempt.span_id
    for name in ("queue", "execute"):
        assert spans[("portico-engine", name)].parent_span_id == served.span_id
    execute = receiver.attributes(spans[("portico-engine", "execute")])
    assert execute["gen_ai.usage.output_tokens"] == 3
    assert receiver.attributes(root)["gen_ai.server.time_to_first_token"] > 0
