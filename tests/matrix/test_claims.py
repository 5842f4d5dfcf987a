"""The static read of `proves` markers: every form, every error, and agreement with pytest's own collection."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
from matrix_helpers import ROOT

from matrix.claims import CLAIMS, claims_in, read_claims
from matrix.errors import BadClaim

# Every place a marker is read from, in one test file.
FORMS = textwrap.dedent('''
    import pytest
    from pytest import mark

    pytestmark = [pytest.mark.proves("LlamaForCausalLM", "engine"), pytest.mark.slow]
    MODELS = [
        pytest.param("bamba", marks=pytest.mark.proves("BambaForCausalLM", "chunked prefill")),
        pytest.param("jamba", id="jamba-case", marks=[pytest.mark.proves("JambaForCausalLM", "engine")]),
        "mamba",
    ]


    @pytest.fixture(params=MODELS)
    def model(request):
        return request.param


    @pytest.fixture
    def loaded(model):
        return model


    def test_via_fixture(loaded):
        pass


    @pytest.mark.parametrize("name", MODELS)
    def test_via_list(name):
        pass


    @pytest.mark.parametrize("name, size", [
        pytest.param("granite", 2, marks=pytest.mark.proves("GraniteForCausalLM", "LoRA")),
        ("other", 1),
    ])
    def test_inline(name, size):
        pass


    @mark.proves("chunked prefill", "Mamba2ForCausalLM", "MambaForCausalLM")
    def test_decorated():
        pass


    class TestGroup:
        pytestmark = pytest.mark.proves("Zamba2ForCausalLM", "CUDA graphs")

        def test_one(self):
            pass


    @pytest.mark.proves("NemotronHForCausalLM", "tensor parallel", "pipeline parallel")
    class TestDecorated:
        def test_two(self):
            pass

        def helper(self):
            pass


    def helper():
        pass
''')
PATH = "test_forms.py"
EVERY_TEST = ["test_via_fixture[bamba]", "test_via_fixture[jamba-case]", "test_via_fixture[mamba]",
              "test_via_list[bamba]", "test_via_list[jamba-case]", "test_via_list[mamba]",
              "test_inline[granite-2]", "test_inline[other-1]", "test_decorated", "TestGroup::test_one",
              "TestDecorated::test_two"]
# (test, architecture, claim); a test without [id] stands for each of its cases.
EXPECTED = {
    ("test_via_fixture[bamba]", "BambaForCausalLM", "chunked prefill"),
    ("test_via_list[bamba]", "BambaForCausalLM", "chunked prefill"),
    ("test_via_fixture[jamba-case]", "JambaForCausalLM", "engine"),
    ("test_via_list[jamba-case]", "JambaForCausalLM", "engine"),
    ("test_inline[granite-2]", "GraniteForCausalLM", "LoRA"),
    ("test_decorated", "Mamba2ForCausalLM", "chunked prefill"),
    ("test_decorated", "MambaForCausalLM", "chunked prefill"),
    ("TestGroup::test_one", "Zamba2ForCausalLM", "CUDA graphs"),
    ("TestDecorated::test_two", "NemotronHForCausalLM", "tensor parallel"),
    ("TestDecorated::test_two", "NemotronHForCausalLM", "pipeline parallel"),
}


def static(source, path=PATH):
    return {(c.test.removeprefix(f"{path}::"), c.architecture, c.claim) for c in claims_in(source, path)}


def test_every_form_is_read():
    got = static(FORMS)
    llama = {entry for entry in got if entry[1:] == ("LlamaForCausalLM", "engine")}
    assert got - llama == EXPECTED
    # The module's pytestmark reaches every test function, whatever its cases.
    assert {test for test, _, _ in llama} == {t.split("[")[0] for t in EVERY_TEST}


def test_a_claim_says_where_its_marker_is():
    claims = [c for c in claims_in(FORMS, PATH) if c.architecture == "GraniteForCausalLM"]
    assert [c.where for c in claims] == [f"{PATH}:{FORMS.splitlines().index(line) + 1}"
                                        for line in FORMS.splitlines() if '"GraniteForCausalLM", "LoRA"' in line]


# A pytest plugin that writes down the proves markers pytest itself sees on each collected test.
DUMP_PLUGIN = textwrap.dedent('''
    import json, os

    def pytest_collection_finish(session):
        found = [[item.nodeid, list(mark.args)] for item in session.items for mark in item.iter_markers("proves")]
        with open(os.environ["PROVES_OUT"], "w") as out:
            json.dump(found, out)
''')


def pytest_collected(tmp_path, cwd, *args):
    """(node id, architecture, claim) for every proves marker on the tests `pytest --collect-only ARGS` collects."""
    (tmp_path / "proves_dump.py").write_text(DUMP_PLUGIN)
    out = tmp_path / "found.json"
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PROVES_OUT": str(out), "PYTHONPATH": path}
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p", "proves_dump",
               "--strict-markers", *args]
    ran = subprocess.run(command, capture_output=True, text=True, cwd=cwd, env=env)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    return {(node_id, a, c) for node_id, names in json.loads(out.read_text())
            for a in names if a not in CLAIMS for c in names if c in CLAIMS}


def assert_agree(static_claims, collected):
    """Each claim pytest sees is read statically, for that case or for its whole test function, and back."""
    assert collected
    for test, architecture, claim in collected:
        assert {(test, architecture, claim), (test.split("[")[0], architecture, claim)} & static_claims, test
    for test, architecture, claim in static_claims:
        assert any(c[1:] == (architecture, claim) and test in (c[0], c[0].split("[")[0]) for c in collected), test


def test_the_static_read_agrees_with_pytest(tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (scratch / PATH).write_text(FORMS)
    (scratch / "pytest.ini").write_text("[pytest]\nmarkers =\n    proves: the claims a test proves\n    slow: slow\n")
    collected = pytest_collected(tmp_path, scratch, "-c", "pytest.ini", PATH)
    assert_agree({(f"{PATH}::{test}", a, c) for test, a, c in static(FORMS)}, collected)


@pytest.mark.slow
def test_the_static_read_agrees_with_pytest_on_this_repository(tmp_path):
    """Collecting imports torch, transformers and the server (seconds); the check reads the source instead."""
    static_claims = {(c.test, c.architecture, c.claim) for c in read_claims(ROOT)}
    assert_agree(static_claims, pytest_collected(tmp_path, ROOT, "tests"))


@pytest.mark.parametrize("source, message", [
    ('@pytest.mark.proves("LlamaForCausalLM", "chunked prefil")\ndef test_x(): pass',
     "proves names 'chunked prefil', which is neither an architecture nor a claim (did you mean 'chunked prefill'?)"),
    ('@pytest.mark.proves("LLamaForCausalLM", "engine")\ndef test_x(): pass',
     "(did you mean 'LlamaForCausalLM'?); architectures: BambaForCausalLM, "),
    ('@pytest.mark.proves("LlamaForCausalLM")\ndef test_x(): pass', "proves needs a claim (engine, prefix caching,"),
    ('@pytest.mark.proves("engine")\ndef test_x(): pass', "proves needs an architecture, e.g. @pytest.mark.proves("),
    ('ARCH = "LlamaForCausalLM"\n@pytest.mark.proves(ARCH, "engine")\ndef test_x(): pass', "string literals only"),
    ('@pytest.mark.proves\ndef test_x(): pass', "a bare pytest.mark.proves proves nothing"),
    ('PROOF = pytest.mark.proves("LlamaForCausalLM", "engine")\n@PROOF\ndef test_x(): pass',
     "cannot tell which test this proves marker is on"),
    ('@pytest.mark.proves("LlamaForCausalLM", "engine")\ndef check_x(): pass', "reaches no test"),
    ('@pytest.fixture(params=[pytest.param(1, marks=pytest.mark.proves("LlamaForCausalLM", "engine"))])\n'
     'def unused(request): pass', "reaches no test"),
    ('@pytest.mark.gpu\n@pytest.mark.proves("LlamaForCausalLM", "engine")\ndef test_x(): pass',
     "test_x is marked gpu, so CI does not run it"),
    ('pytestmark = pytest.mark.skip(reason="later")\n@pytest.mark.proves("LlamaForCausalLM", "engine")\n'
     'def test_x(): pass', "test_x is marked skip"),
])
def test_a_marker_that_proves_nothing_is_an_error(source, message):
    with pytest.raises(BadClaim) as err:
        claims_in("import pytest\n" + source, "tests/test_x.py")
    assert message in str(err.value)
    assert str(err.value).startswith("tests/test_x.py:")
    assert err.value.exit_code == 3


def test_the_repository_proofs_are_read():
    tests = {claim.test for claim in read_claims(ROOT)}
    assert "tests/engine/test_parity.py::test_greedy_tokens_and_logprobs_match_transformers[bamba]" in tests
    assert "tests/engine/test_scheduling.py::test_chunked_prefill_equals_one_shot" in tests
