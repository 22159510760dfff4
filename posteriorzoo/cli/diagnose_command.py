"""``posteriorzoo diagnose``: what a collection's samples and recorded training say."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from posteriorzoo.cli._types import add_json_option, add_no_verify_option


def _flag_help() -> str:
    # The thresholds live in the diagnostics core; reading them here would import numpy at
    # --help time, so the help restates them and tests/test_diagnose.py checks they agree.
    return ("Flags: 'ESS below half the samples' (median bulk ESS < 0.5 x the draws); "
            "'chains disagree (R-hat > 1.05)' (median rank-normalised split R-hat > 1.05); "
            "'chain too hot' (kinetic temperature mean(v^2)/lr above 1.1 x the exact "
            "chain's 1/(1 - alpha/2)); 'variance did not train' (every layer's median sigma "
            "within a factor 1.25 of its initial value); 'E-BFMI below 0.3' (a chain's "
            "recorded E-BFMI < 0.3, Betancourt 2016); 'acceptance far from its target "
            "(outside 0.5 .. 0.99)' (a chain's recorded mean acceptance probability after "
            "burn-in outside 0.5 .. 0.99).")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "diagnose", help="check that a collection's samples are what its method promises",
        description="Diagnose collections from their samples and recorded training, without "
                    "trusting the method. Every collection: the spread of its members' test "
                    "accuracies, the ensemble's IDMI (on its dataset's test split) and what "
                    "the method recorded when it was built. Chains (SGHMC, HMC): effective "
                    "sample size and split R-hat per weight (ArviZ; across the chains of one "
                    "mode, or one chain's halves), lag-k autocorrelation, the drift between "
                    "the two halves of each chain (summarised as median and worst tenth), "
                    "the same with the symmetries removed and on each sample's test "
                    "log-likelihood, the spread between chains said as modes, and what each "
                    "chain recorded (kinetic temperature; HMC's acceptance and E-BFMI). "
                    "Variational (BBB): "
                    "per layer, the samples' sigma against the initial sigma. What a "
                    "collection made before training records existed cannot tell is "
                    "reported as unknown. Checkpoints with NaN or infinite weights "
                    "(flagged diverged) are left out of every statistic, and counted. "
                    + _flag_help())
    parser.add_argument("zoos", type=Path, nargs="+", help="collection files (.h5)")
    parser.add_argument("--no-predictions", action="store_true",
                        help="skip the forward passes (no IDMI; no dataset needed)")
    parser.add_argument("--data-dir", type=Path,
                        help="folder searched first for the dataset files")
    add_no_verify_option(parser)
    add_json_option(parser, "one JSON list with every collection's diagnostics")
    parser.set_defaults(func=run)


def _number(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _print(result) -> None:
    data = result.to_dict()
    print(data["path"])
    print(f"  method        {data['method']}")
    if data["left_out"]:
        count = data["left_out"]
        print(f"  left out      {count} diverged checkpoint{'s' if count > 1 else ''} (NaN "
              "or infinite weights): every statistic is of the others")
    accuracy = data["diversity"]["test_accuracy"]
    if accuracy:
        print(f"  test accuracy min {accuracy['min']:.4f}  median {accuracy['median']:.4f}  "
              f"max {accuracy['max']:.4f}  std {accuracy['std']:.4f}")
    print(f"  IDMI          {_number(data['diversity']['idmi'])}")
    for chain in data["chains"] or []:
        print(f"  mode {chain['mode']}: {chain['chains']} chain(s) x {chain['draws']} draws: "
              f"ESS median {chain['ess']['median']:.1f} (worst tenth "
              f"{chain['ess']['worst_tenth']:.1f}), R-hat median {chain['r_hat']['median']:.3f} "
              f"(worst tenth {chain['r_hat']['worst_tenth']:.3f}, max "
              f"{chain['r_hat']['worst']:.3f}, {100 * chain['r_hat_above_1_01']:.0f}% of "
              f"weights above 1.01), lag-1 autocorrelation "
              f"{chain['autocorrelation'].get('1', {}).get('median', float('nan')):.3f}, "
              f"drift {chain['drift']['median']:.2f} sd"
              + ("" if chain.get("acceptance_rate") and chain["kinetic_temperature"] is None
                 else f", kinetic temperature {_number(chain['kinetic_temperature'])}"))
        _print_chain_details(chain)
    if data.get("between_chains"):
        print(f"  between chains: {data['between_chains']['sentence']}")
    for layer in data["variational"] or []:
        if layer["layer"] == "(recorded)":   # printed with the build records below
            continue
        if layer["sample_sigma"] is None:  # recorded scales (Rank-1's factors)
            value = f"scale {layer['final_sigma']:.3g} at the end of training"
        else:
            value = f"sigma {layer['sample_sigma']:.3g}"
        print(f"  mode {layer['mode']} {layer['layer']}: {value} "
              f"(initial {layer['initial_sigma']:.3g}, moved x{layer['moved_factor']:.2f})")
    for mode, record in data["build"].items():
        print(f"  mode {mode} build record: {json.dumps(record)}")
    for flag in data["flags"]:
        print(f"  FLAG {flag}")
    if not data["flags"]:
        print("  no flags")
    for line in data["unknown"]:
        print(f"  unknown: {line}")


def _numbers(values: list | None) -> str:
    return "not recorded" if values is None else ", ".join(_number(v) for v in values)


def _print_chain_details(chain: dict) -> None:
    """The lines under a mode's chain statistics: its sampler's record, its canonical
    weights' statistics and its test log-likelihood's."""
    if chain.get("acceptance_rate") is not None:
        target = chain.get("target_accept")
        print(f"    sampler: acceptance {_numbers(chain['acceptance_rate'])} (target "
              f"{_number(target)}), E-BFMI {_numbers(chain.get('e_bfmi'))}, step "
              f"{_numbers(chain.get('step_size'))} x {_numbers(chain.get('leapfrog_steps'))} "
              f"leapfrog steps, divergences {_numbers(chain.get('divergences'))}")
    removed = chain.get("symmetries_removed")
    if removed:
        print(f"    symmetries removed: ESS median {removed['ess']['median']:.1f} (worst "
              f"tenth {removed['ess']['worst_tenth']:.1f}), R-hat median "
              f"{removed['r_hat']['median']:.3f} (max {removed['r_hat']['worst']:.3f}, "
              f"{100 * removed['r_hat_above_1_01']:.0f}% of weights above 1.01)")
    predictive = chain.get("log_likelihood")
    if predictive:
        print(f"    test log-likelihood: ESS {predictive['ess']:.1f}, R-hat "
              f"{predictive['r_hat']:.3f}, lag-1 autocorrelation "
              f"{predictive['autocorrelation'].get('1', float('nan')):.3f}, chain means "
              f"{_numbers(predictive['mean'])}")


def run(args: argparse.Namespace) -> int:
    from posteriorzoo.collection import diagnose
    from posteriorzoo.results import strict_json

    results = [diagnose(path, predictions=not args.no_predictions,
                        data_dir=None if args.data_dir is None else str(args.data_dir),
                        verify=not args.no_verify, command=args.command_line)
               for path in args.zoos]
    if args.json:
        print(strict_json([result.to_dict() for result in results], indent=1))
        return 0
    for result in results:
        _print(result)
    return 0
