"""What the tests share that is not a fixture: rank workers, crash children, the memory tier."""
