from distrib.cli import entry

entry()
