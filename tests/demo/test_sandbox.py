"""Sandbox: isolation, limits and protocol robustness. Most cases share one child process."""

import pytest

from demo.sandbox import run_functions

_ADD_ONE = "def f(x):\n    return x + 1\n"


def test_results_are_json_normalised_and_in_order():
    results = run_functions(
        [
            (_ADD_ONE, [(1,), (41,)]),
            ("def f(xs):\n    return tuple(xs), None\n", [([1, 2],)]),
            ("def f(x):\n    return 1 / x\n", [(0,), (4,)]),
        ]
    )
    assert [r.ok for r in results] == [True, True, False]
    assert results[0].results == [2, 42]
    assert results[1].results == [[[1, 2], None]]
    assert results[2].results == [None, 0.25]
    assert results[2].call_errors[0].startswith("ZeroDivisionError")
    assert results[2].error == results[2].call_errors[0]


def test_hostile_items_fail_and_neighbours_still_run(tmp_path):
    target = tmp_path / "written.txt"
    items = [
        ("def f(x):\n    while True:\n        pass\n", [(1,)]),
        (_ADD_ONE, [(1,)]),
        (f"def f(x):\n    open({str(target)!r}, 'w').write('x')\n", [(1,)]),
        ("def f(x):\n    open('local.txt', 'a')\n", [(1,)]),
        ("def f(x):\n    import socket\n    return socket.socket()\n", [(1,)]),
        ("def f(x):\n    import os\n    return os.system('true')\n", [(1,)]),
        ("def f(x):\n    import subprocess\n    return subprocess.run(['true'])\n", [(1,)]),
        ("def f(x):\n    return len(bytearray(2 ** 34))\n", [(1,)]),
        ("def f(x)\n    return x\n", [(1,)]),
        ("def f(x):\n    print('noise')\n    print('{\"i\": 0}')\n    return x * 2\n", [(5,)]),
        ("def f(x):\n    import os\n    os.write(1, b'junk\\n')\n    return x\n", [(3,)]),
        # A C-level loop ignores the in-child alarm: the parent kills the child and restarts it.
        ("def f(x):\n    return sum(range(10 ** 13))\n", [(1,)]),
        # Swallowing the exception does not make a blocked action count as success.
        (
            "def f(x):\n    try:\n        import socket\n        socket.socket()\n"
            + "    except Exception:\n        pass\n    return x\n",
            [(1,)],
        ),
        (_ADD_ONE, [(9,)]),
    ]
    results = run_functions(items, timeout_s=0.3)
    assert len(results) == len(items)
    loop, ok1, file_abs, file_rel, sock, system, popen, memory, syntax, prints, fd1, c_loop, caught, ok2 = results
    assert (loop.ok, loop.error) == (False, "timeout")
    assert ok1.ok and ok1.results == [2]
    assert file_abs.error.startswith("blocked: file write") and not target.exists()
    assert file_rel.error.startswith("blocked: file write")
    assert sock.error.startswith("blocked: network")
    assert system.error.startswith("blocked: process")
    assert popen.error.startswith("blocked: process")
    assert memory.error == "MemoryError"
    assert syntax.results is None and syntax.error.startswith("SyntaxError")
    assert prints.ok and prints.results == [10]
    assert fd1.ok and fd1.results == [3]
    assert (c_loop.ok, c_loop.error) == (False, "timeout")
    assert not caught.ok and caught.error.startswith("blocked: network")
    assert ok2.ok and ok2.results == [10]


def test_missing_function_and_bad_results():
    none_defined, unserialisable, exits = run_functions(
        [
            ("g = 1\n", [(1,)]),
            ("def f(x):\n    return {x}\n", [(1,)]),
            ("def f(x):\n    import os\n    os._exit(3)\n", [(1,)]),
        ]
    )
    assert none_defined.error.startswith("NameError")
    assert unserialisable.error.startswith("unserialisable result")
    assert exits.error == "crashed: exit code 3"


def test_empty_batch_and_bad_timeout():
    assert run_functions([]) == []
    with pytest.raises(ValueError, match="0"):
        run_functions([(_ADD_ONE, [(1,)])], timeout_s=0)
