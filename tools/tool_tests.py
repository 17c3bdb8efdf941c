"""Shared by the tools' tests (tools/test_*.py): a temporary file that the
test case removes when it ends."""
import os
import tempfile


def temp_file(case, text, suffix):
    """Writes text to a new temporary file named ...suffix, removed at the
    end of the unittest.TestCase `case`; returns its path."""
    f = tempfile.NamedTemporaryFile("w", suffix=suffix, delete=False)
    f.write(text)
    f.close()
    case.addCleanup(os.unlink, f.name)
    return f.name
