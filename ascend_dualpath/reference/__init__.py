"""Pure-torch reference semantics, written for clarity rather than speed, that tests check the real paths against."""
