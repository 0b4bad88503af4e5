"""placeholder until the package lands."""
