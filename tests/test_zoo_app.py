"""The app's Zoo tab in Debian's chromium: choosing a zoo model fills the form with its recommendation."""
import re

from zoo import entries as zoo
from recipes.registry import load_backends

from tests.conftest import launch_browser
from tests.test_app import app  # noqa: F401  (the running app fixture, shared)


def test_zoo_tab_fills_the_hub_repo_and_preselects_recommended_recipes(app):  # noqa: F811
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as p:
        browser = launch_browser(p)
        page = browser.new_page(viewport={"width": 1400, "height": 1800})
        page.goto(app["url"])
        page.get_by_role("tab", name="Zoo").click()
        page.locator("#zoo-model input").click()
        page.get_by_role("option", name="meta-llama/Llama-3.2-1B-Instruct").click()
        expect(page.locator("#zoo-recommended")).to_contain_text("coreml-int4", timeout=30_000)
        expect(page.locator("#zoo-recommended")).to_contain_text("xnnpack-8da4w")
        expect(page.get_by_text("unsloth/Llama-3.2-1B-Instruct")).to_be_visible()
        page.get_by_role("tab", name="Lower").click()  # the filled form is the Lower tab's
        expect(page.get_by_label("Hugging Face Hub repo")).to_be_checked()
        expect(page.get_by_label("Hub repo id")).to_have_value("meta-llama/Llama-3.2-1B-Instruct")
        expect(page.locator("#recipes-coreml").get_by_role("checkbox", name=re.compile(r"^coreml-int4 "))).to_be_checked()
        expect(page.locator("#recipes-xnnpack").get_by_role("checkbox", name=re.compile(r"^xnnpack-8da4w "))).to_be_checked()
        page.get_by_text("Advanced").click()
        expect(page.get_by_label("Max context (tokens)")).to_have_value("1024")
        expect(page.get_by_label("Weight group size")).to_have_value("128")

        # The backend filter, on what the matrix measured: a measured backend keeps its rows and drops the
        # others'; a backend with no measured cell empties the table.
        cells = zoo.read_results()
        shown = cells[0].backend
        others = {c.recipe for c in cells if c.backend != shown}
        unmeasured = next(b for b in load_backends().backends if b not in {c.backend for c in cells})
        page.get_by_role("tab", name="Zoo").click()
        pick_backend(page, shown)
        expect(page.locator("#zoo-table")).to_contain_text(cells[0].recipe, timeout=30_000)
        for recipe in others:
            expect(page.locator("#zoo-table")).not_to_contain_text(recipe)
        pick_backend(page, unmeasured)
        expect(page.locator("#zoo-table")).not_to_contain_text(cells[0].recipe, timeout=30_000)
        browser.close()


def pick_backend(page, name: str) -> None:
    page.locator("#zoo-backend input").click()
    page.get_by_role("option", name=name, exact=True).click()
