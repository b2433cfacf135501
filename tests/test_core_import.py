def test_version_lives_in_one_place():
    from importlib.metadata import version

    import lossscale_callbacks

    assert lossscale_callbacks.__version__ == version("lossscale-callbacks")
