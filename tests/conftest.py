def pytest_addoption(parser):
    parser.addoption("--run-large", action="store_true", default=False,
                     help="run GPU tests that need several GB of device memory")
