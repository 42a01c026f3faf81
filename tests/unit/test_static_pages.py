"""The chat page's and the dashboard's static files (app/api/static), without a
browser: served without a token, shipped in the package, and holding to the pages'
rules: no external resource, nothing peers or the model wrote set as HTML, the token
sent only as Authorization: Bearer. (In Chromium: tests/integration/test_chat_page.py.)"""

import re
import tomllib
from pathlib import Path

import pytest
from starlette.testclient import TestClient

from compushare.app.api.app import STATIC_DIR, build_app
from compushare.app.api.dashboard import DASHBOARD_HTML
from compushare.app.api.engine import ChatEngine

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
FILES = ("chat.html", "chat.css", "chat.js", "charts.js")


class NoControl:
    def status(self) -> dict:
        return {}

    dashboard = status

    def pause(self) -> bool:
        return False

    resume = pause


@pytest.fixture
def client(tmp_path):
    engine = ChatEngine(None, None, tmp_path, torrent=None, default_model="tiny")  # never generates here
    with TestClient(build_app(engine, "secret-token", NoControl()), backend="trio") as test_client:
        yield test_client


def test_the_pages_and_their_files_are_served_without_a_token(client):
    page = client.get("/chat")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert '<script src="/static/chat.js">' in page.text and 'href="/static/chat.css"' in page.text
    for name in FILES:
        response = client.get(f"/static/{name}")
        assert response.status_code == 200 and response.text == (STATIC_DIR / name).read_text(), name
    assert '<script src="/static/charts.js">' in client.get("/dashboard").text
    for bad in ("../app.py", "..%2Fapp.py", ".hidden", "nothing.js"):
        assert client.get(f"/static/{bad}").status_code == 404, bad


def test_the_static_files_ship_in_the_package():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"]["compushare.app.api"]
    shipped = {path.name for pattern in patterns for path in STATIC_DIR.parent.glob(pattern)}
    assert set(FILES) <= shipped


def test_no_external_resource_no_html_from_text_and_the_token_only_in_a_header():
    texts = {name: (STATIC_DIR / name).read_text() for name in FILES} | {"dashboard": DASHBOARD_HTML}
    for name, text in texts.items():
        urls = set(re.findall(r"https?://[^\s\"'`)]+", text)) - {"http://www.w3.org/2000/svg"}
        assert urls == set(), name  # SVG's namespace is a name, never fetched
        assert not re.search(r"\b(innerHTML|outerHTML|insertAdjacentHTML|document\.write)\b", text), name
        assert "@import" not in text and "url(" not in text, name
    script = texts["chat.js"]
    assert script.count("TOKEN") == 3  # read from the fragment, checked, sent only as a bearer header
    assert '"Bearer " + TOKEN' in script and 'location.hash.slice(1)' in script
