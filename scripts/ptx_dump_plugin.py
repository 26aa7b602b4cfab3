"""pytest plugin of ``ptx_digest.py``: every ``cute.compile``'s PTX files moved out of
``CUTE_DSL_DUMP_DIR`` into a folder of their own, named by the test and the compile's index
in it (the DSL names a dump after the function and its argument types, so configurations
that differ only in constants overwrite each other's file in one folder)."""

import os
import pathlib
import re

_state = {"test": "collect", "index": 0}


def pytest_runtest_setup(item):
    _state["test"], _state["index"] = item.nodeid, 0


def pytest_configure(config):
    import cutlass.cute as cute

    dump = pathlib.Path(os.environ["CUTE_DSL_DUMP_DIR"])
    compile_ = cute.compile

    def compile_and_keep(*args, **kwargs):
        try:
            return compile_(*args, **kwargs)
        finally:
            files = sorted(dump.glob("*.ptx"))
            if files:
                name = re.sub(r"[^\w.-]+", "_", _state["test"])[-150:]
                folder = dump / f"{name}__{_state['index']}"
                folder.mkdir(parents=True, exist_ok=True)
                for f in files:
                    f.rename(folder / f.name)
                _state["index"] += 1

    cute.compile = compile_and_keep
