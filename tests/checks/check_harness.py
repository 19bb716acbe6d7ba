"""What the tests of the repository's checks share: running a check on a tree, and the ok/FAIL
lines with the exit status. A test plants a rule break in a copy of the tree and expects the
check to catch it, naming it."""
import os
import shutil
import subprocess
import sys


class CheckTest:
    def __init__(self, root, script):
        self.root = os.path.abspath(root)
        self.script = os.path.join(self.root, "scripts", script)
        self.failures = []

    def run(self, tree):
        """The check on `tree`: its exit status and what it printed."""
        result = subprocess.run([sys.executable, self.script, tree], capture_output=True, text=True)
        return result.returncode, result.stdout + result.stderr

    def expect(self, name, condition, output):
        print(("ok   " if condition else "FAIL ") + name)
        if not condition:
            print(output)
            self.failures.append(name)

    def copy(self, target, folders):
        """Copies the repository's `folders` into `target`, where a test plants its break."""
        for folder in folders:
            shutil.copytree(os.path.join(self.root, folder), os.path.join(target, folder))

    def exit(self):
        sys.exit(1 if self.failures else 0)
