"""Config: typed defaults, TOML files, dotted overrides, and a resolved config that reads back unchanged."""



from distrib.config import load_config


def test_toml_then_overrides_in_order(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[train]\nlr = 0.1\nepochs = 3\n[data]\nname = "synthetic"\n')
    config = load_config(str(path), ["train.lr=0.2", "train.lr=1e-3", "data.root=/tmp/x y", "run.dir=123",
                                     "run.progress=false", "train.weight_decay=1"])
    assert config.train.lr == 0.001 and config.train.epochs == 3
    assert config.data.name == "synthetic" and config.data.root == "/tmp/x y"
    assert config.run.dir == "123" and config.run.progress is False
    assert config.train.weight_decay == 1.0 and isinstance(config.train.weight_decay, float)
