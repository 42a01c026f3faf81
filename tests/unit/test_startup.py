"""Start-up: seed-only code stays free of torch, and the cyclic collector is paused while
a process starts, then skips what start-up built (gc_policy.py). Each test runs in a
fresh interpreter: both are about a process's whole life."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_seeding_and_fetching_code_does_not_import_torch():
    assert _python("""
        import sys
        import compushare.app.seed, compushare.karma.rules, compushare.runtime, compushare.torrent.service
        import compushare.proofs.reports
        print("torch" in sys.modules)
    """) == "False"


def test_commands_start_with_the_collector_paused_and_run_with_it_on_over_a_frozen_start_up():
    assert _python("""
        import gc, sys
        from compushare.app import cli

        seen = []

        @cli.app.command("probe")
        def probe():
            seen.append(gc.isenabled())  # a command's imports happen here
            cli.run_or_exit(lambda: seen.append((gc.isenabled(), gc.get_freeze_count() > 0)))

        for argv in (["probe"], ["no-such-command"]):
            sys.argv = ["compushare", *argv]
            try:
                cli.main()
            except SystemExit:
                pass
            seen.append(gc.isenabled())  # on again after a command, or after a usage error
        print(seen)
    """) == "[False, (True, True), True, True]"


def test_a_consumer_loads_its_head_without_transformers(tiny_model):
    # The head is embeddings, the final norm and the LM head: torch only. Importing
    # transformers' modeling code would cost every `run` seconds before its first token.
    assert _python(f"""
        import sys
        import compushare.pipeline.client.consumer
        from compushare.model.head import ConsumerHead
        ConsumerHead.load({str(tiny_model)!r}).logits(ConsumerHead.load({str(tiny_model)!r}).embed_tokens([1, 2]))
        print(sorted(m for m in sys.modules if m == "transformers" or m.startswith("transformers.")))
    """) == "[]"
