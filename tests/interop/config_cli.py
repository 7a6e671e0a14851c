"""nnm2nxdt-config as a command: files, stdin/stdout, the JSON report, and bad input."""
import json
import os
import subprocess
import unittest

from canon import CONFIG, TempDirTest

HERE = os.path.dirname(os.path.abspath(__file__))
NNM = os.path.join(HERE, "..", "data", "configs", "megatron_llama_config.yaml")


def run(*args, stdin=None):
    return subprocess.run([CONFIG, *args], input=stdin, capture_output=True, text=True)


class ConfigCli(TempDirTest):
    def path(self, name):
        return os.path.join(self.dir, name)

    def write(self, name, text):
        with open(self.path(name), "w") as f:
            f.write(text)
        return self.path(name)

    def test_file_to_file_with_report(self):
        out, rep = self.path("out.yaml"), self.path("rep.json")
        # An output that would not pass --check is not written without --allow-incomplete (12 heads over tp 5).
        p = run(NNM, "-o", out, "--report", rep, "model.tensor_model_parallel_size=5", "+model.save_xser=True")
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("does not pass --check", p.stderr)
        self.assertFalse(os.path.exists(out) or os.path.exists(rep))
        # The closing line names the problem (the heads), and does not send the user after data_prefix.
        closing = p.stderr.strip().splitlines()[-1]
        self.assertIn("nothing was written", closing)
        self.assertIn("tensor_model_parallel_size (5)", closing)
        self.assertNotIn("data_prefix", closing)
        # NNM's own example holds data_prefix: ??? (OmegaConf's mandatory marker): carried over, set at launch, exit 0.
        p = run(NNM, "-o", out, "--report", rep, "model.tensor_model_parallel_size=2", "+model.save_xser=True", "trainer.devices=2")
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual(p.stderr.count("kept as ???"), 1)
        self.assertEqual(p.stdout, "")
        with open(rep) as f:
            report = json.load(f)
        self.assertEqual(report["overrides"], ["model.tensor_model_parallel_size=2", "+model.save_xser=True", "trainer.devices=2"])
        fates = {k["key"]: k for k in report["keys"]}
        self.assertEqual(fates["model.tensor_model_parallel_size"]["to"], "distributed_strategy.tensor_model_parallel_size")
        self.assertEqual(fates["model.fp8"]["fate"], "dropped")
        self.assertIn("fp8 training is not supported", fates["model.fp8"]["reason"])
        self.assertEqual(fates["model.grad_allreduce_chunk_size_mb"]["fate"], "unknown")
        self.assertIn("moved", report["summary"])
        self.assertEqual(report["check"], [])
        self.assertEqual(report["set_at_launch"], ["data.data_prefix"])
        with open(out) as f:
            text = f.read()
        self.assertIn("distributed_strategy:\n  tensor_model_parallel_size: 2\n", text)
        self.assertIn("  save_xser: True\n", text)
        self.assertIn("dropped  model.fp8:", p.stderr)
        self.assertIn("  data_prefix: ???\n", text)
        # --check agrees with the report: nothing wrong, one value to set at launch.
        c = run("--check", out)
        self.assertEqual(c.returncode, 0, c.stderr)
        self.assertIn(f"{out}: data.data_prefix: ??? (mandatory): to be set at launch with an override (data.data_prefix=...)", c.stderr)

    def test_nnms_own_example_configs_migrate_with_exit_0(self):
        """NNM's example configs as NNM ships them (neuronx-nemo-megatron f4743ce,
        nemo/examples/nlp/language_modeling/conf/) migrate with no extra arguments.
        Mistral's and Llama 70B's name 32 x 2 devices (dp 64) with a global batch of
        8, which their launch scripts override: a warning for launch, not an error."""
        configs = os.path.join(HERE, "..", "data", "configs")
        world_mismatch = "data.global_batch_size (8) is not a multiple of data.micro_batch_size (4) * data-parallel size (64) = 256"
        for name, at_launch in (("nnm_megatron_gpt_config", False), ("megatron_llama_config", False),
                                ("megatron_mistral_config", True), ("megatron_llama_70b_config", True)):
            with self.subTest(name):
                out, rep = self.path(name + ".nxdt.yaml"), self.path(name + ".json")
                p = run(os.path.join(configs, name + ".yaml"), "-o", out, "--report", rep)
                self.assertEqual(p.returncode, 0, p.stderr)
                with open(rep) as f:
                    report = json.load(f)
                self.assertEqual(report["check"], [])
                self.assertEqual(report["set_at_launch"], ["data.data_prefix"])
                self.assertEqual([m.split(" at ")[0] for m in report["at_launch"]], [world_mismatch] if at_launch else [])
                self.assertEqual(p.stderr.count("launch scripts set these sizes"), int(at_launch))
                c = run("--check", out)
                self.assertEqual(c.returncode, 0, c.stderr)
                self.assertEqual(c.stderr.count(": at launch: as written, " + world_mismatch), int(at_launch), c.stderr)
        # A value wrong at any world size is still refused: nothing written.
        out = self.path("bad.yaml")
        p = run(os.path.join(configs, "megatron_mistral_config.yaml"), "-o", out, "model.micro_batch_size=3")
        self.assertEqual(p.returncode, 2, p.stderr)
        self.assertIn("data.global_batch_size (8) is not a multiple of data.micro_batch_size (3)", p.stderr)
        self.assertFalse(os.path.exists(out))

    def test_stdin_to_stdout(self):
        with open(NNM) as f:
            p = run("model.data.data_prefix=[1.0,/data/x]", stdin=f.read())
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertTrue(p.stdout.startswith("name: megatron_llama\n\nmodel_source: megatron\n\nseed: 1234\n"))
        self.assertIn("  data_prefix: [1.0, /data/x]\n", p.stdout)
        self.assertIn("<stdin>", p.stderr)
        out = self.write("good.yaml", p.stdout)
        self.assertEqual(run("--check", out).returncode, 0)

    def test_bad_input_exits_2_naming_the_problem_and_writes_nothing(self):
        cases = {
            "not_yaml.yaml": ("a: [1, 2\nb: 3\n", [], "not_yaml.yaml:"),
            "list.yaml": ("- 1\n- 2\n", [], "list.yaml: the top level must be a mapping"),
            "dup.yaml": ("model:\n  num_layers: 2\n  num_layers: 4\n", [], "dup.yaml:3: duplicate key 'model.num_layers'"),
            "override.yaml": ("model:\n  x: 1\n", ["model.x"], "override 'model.x': missing '=value'"),
            "unknown_override.yaml": ("model:\n  x: 1\n", ["model.y=2"], "key 'model.y' is not in the config"),
            "dangling.yaml": ("model:\n  x: 1\n  y: ${model.z}\n", [], "dangling.yaml:3: key 'model.y': interpolation '${model.z}' points to 'model.z'"),
        }
        for name, (text, overrides, message) in cases.items():
            with self.subTest(name):
                src = self.write(name, text)
                out = self.path(name + ".out")
                p = run(src, "-o", out, *overrides)
                self.assertEqual(p.returncode, 2, p.stderr)
                self.assertIn(message, p.stderr)
                self.assertFalse(os.path.exists(out))
                self.assertEqual([f for f in os.listdir(self.dir) if "tmp" in f], [])

    def test_existing_output_survives_a_failed_run(self):
        out = self.write("out.yaml", "precious: 1\n")
        p = run(self.write("dup.yaml", "a: 1\na: 2\n"), "-o", out)
        self.assertEqual(p.returncode, 2)
        with open(out) as f:
            self.assertEqual(f.read(), "precious: 1\n")


if __name__ == "__main__":
    unittest.main()
