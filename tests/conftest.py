"""Shared test configuration: the probe log of the reliability tests.

With ``POSTERIORZOO_PROBE_LOG=FILE``, every run of a test listed in :data:`PROBES` appends
one JSON line (command, class, whether it passed) to FILE, next to the lines the fuzz
and fault-injection suites write themselves; ``tests/probe_table.py FILE`` prints the
table of probes tried and probes that behaved as promised.
"""

from __future__ import annotations

import json
import os

import pytest

import posteriorzoo._numba

# In this process the numba kernels compile in whichever test first uses them (a fresh
# cache, as in CI's clone or make test-avx2), and the one-time notice of that compilation
# would add a line to that test's stderr, failing whichever one-line-error test it happens
# to be. The notice itself is tested in subprocesses (test_cli_startup); here it is off.
posteriorzoo._numba._registered = True

# test module -> test function (or one of its parameters, "test[id]") -> (command, class)
PROBES: dict[str, dict[str, tuple[str, str]]] = {
    "test_append_kills.py": {      # each parameter is a probe: one kill point or seed
        "test_kill_at_every_step_of_an_append": ("append", "kill inside append"),
        "test_kill_while_a_file_is_rebuilt_before_its_first_append": ("append",
                                                                      "kill inside append"),
        "test_kill_an_import_at_every_step": ("import-into", "kill inside append"),
        "test_kill_at_random_moments": ("append", "kill inside append"),
        "test_kill_at_random_moments_many": ("append", "kill inside append"),
    },
    "test_writer_contention.py": {
        "test_declared_rows_beyond_one_append_are_refused_at_once": ("info, verify, import",
                                                                     "declared size"),
        "test_rows_of_one_interrupted_append_are_never_read_and_cut_off_by_a_rebuild": (
            "verify, import", "declared size"),
        "test_an_append_while_another_writer_holds_the_collection_is_busy": (
            "import-into", "concurrent append"),
        "test_two_imports_at_once": ("import-into", "concurrent append"),
    },
    "test_row_order.py": {
        "test_verify_reports_rows_out_of_mode_order": ("verify", "rows out of order"),
        "test_reorder_respects_the_output_policy": ("reorder", "output policy"),
        "test_reorder_refuses_a_damaged_collection_and_writes_nothing": ("reorder", "content"),
        "test_reorder_waits_for_no_writer": ("reorder", "busy"),
        "test_killed_reorder_leaves_nothing_and_a_rerun_succeeds": ("reorder", "sigkill"),
    },
    "test_annotate.py": {
        "test_the_output_policy": ("annotate", "output policy"),
        "test_a_damaged_checkpoint_is_refused_and_nothing_is_written": ("annotate",
                                                                        "content"),
        "test_a_damaged_training_record_is_refused_and_nothing_is_written": ("annotate",
                                                                             "content"),
        "test_a_writer_holding_the_collection_is_waited_for_by_nobody": ("annotate", "busy"),
        "test_a_killed_run_leaves_the_input_and_no_output": ("annotate", "sigkill"),
        "test_missing_and_non_collection_files_are_refused": ("annotate", "bad input"),
    },
    "test_hub_dry_run.py": {
        "test_upload_without_a_token_is_one_line": ("upload", "no token"),
        "test_download_dry_run_lists_files_sizes_and_commit_and_fetches_nothing": (
            "download", "dry run"),
        "test_download_dry_run_into_a_folder_says_what_would_be_kept_or_refused": (
            "download", "dry run"),
        "test_upload_dry_run_lists_what_would_be_sent_and_contacts_nobody": ("upload",
                                                                             "dry run"),
    },
    "test_exchange_hostile.py": {
        "test_export_never_writes_onto_its_input": ("export", "output policy"),
        "test_export_refuses_an_existing_output_unless_overwrite": ("export", "output policy"),
        "test_export_all_refuses_an_existing_folder_unless_overwrite": ("export-all",
                                                                        "output policy"),
        "test_export_needs_an_existing_parent_folder": ("export", "output policy"),
        "test_export_verifies_checkpoints": ("export", "content"),
        "test_one_bad_header_among_good_files_changes_nothing": ("import", "bad header"),
        "test_bad_tensor_dtype_and_bad_values": ("import", "bad header"),
        "test_failed_import_into_a_new_path_leaves_no_file": ("import", "all or nothing"),
        "test_import_refuses_the_collection_as_its_own_input": ("import", "output policy"),
        "test_reimport_adds_nothing_and_repeats_are_skipped": ("import", "all or nothing"),
        "test_import_killed_part_way_finishes_when_run_again": ("import", "sigkill"),
        "test_zero_filled_file_is_refused_at_once": ("import", "hostile archive"),
        "test_huge_declared_header_is_refused": ("import", "hostile archive"),
        "test_header_and_file_size_limits": ("import", "hostile archive"),
        "test_archive_member_declared_too_large": ("import", "hostile archive"),
        "test_gzip_bombs_fail_fast_with_bounded_memory": ("import", "hostile archive"),
        "test_bad_key_maps_are_refused": ("import", "bad key map"),
        "test_key_map_matching_time_is_bounded_in_total": ("import", "regex budget"),
        "test_a_key_map_over_the_cap_is_refused_unread": ("import", "bad key map"),
        "test_altered_tensor_bytes_are_refused": ("import", "content"),
        "test_input_without_a_digest_imports_with_one_warning": ("import", "content"),
        "test_gzip_bomb_member_without_architecture_stays_small": ("import",
                                                                   "hostile archive"),
        "test_well_formed_bomb_header_is_refused_before_its_tensors": ("import",
                                                                       "hostile archive"),
        "test_huge_declared_tensors_are_refused_from_the_header": ("import",
                                                                   "hostile archive"),
        "test_tensor_entries_must_cover_the_data_exactly": ("import", "hostile archive"),
    },
    "test_data.py": {
        "test_gzip_bombs_in_data_dir_are_refused_with_bounded_memory": ("dataset",
                                                                        "hostile archive"),
        "test_archive_members_are_bounded_before_decompression": ("dataset",
                                                                  "hostile archive"),
        "test_verify_local_files": ("dataset", "content"),
        "test_local_files_are_checked_once_per_process": ("dataset", "content"),
    },
    "test_hub.py": {
        "test_download_out_refuses_a_different_file_before_any_transfer": ("download",
                                                                           "output policy"),
        "test_download_out_compares_fetched_bytes_when_the_list_cannot_tell": (
            "download", "output policy"),
        "test_download_that_fails_verification_publishes_nothing": ("download", "content"),
        "test_repo_file_names_outside_the_folder_are_one_line": ("download",
                                                                 "hub fake endpoint"),
        "test_non_utf8_manifest_is_one_line": ("download", "hub fake endpoint"),
        "test_non_utf8_manifest_beside_a_collection_is_reported": ("verify", "content"),
        "test_unexpected_create_repo_answer_is_one_line": ("upload", "hub fake endpoint"),
        "test_fake_hub_download_errors_are_one_line": ("download", "hub fake endpoint"),
        "test_fake_hub_upload_errors_are_one_line": ("upload", "hub fake endpoint"),
        "test_manifest_over_the_cap_is_one_line": ("download", "manifest size"),
    },
    "test_manifest.py": {
        "test_a_manifest_over_the_cap_is_refused_unread": ("verify", "manifest size"),
        "test_a_manifest_without_a_size_is_read_up_to_the_cap": ("verify", "manifest size"),
        "test_a_long_bad_line_is_shown_cut_short": ("verify", "manifest size"),
    },
    "test_full_disk.py": {
        "test_full_disk[canonicalize]": ("canonicalize", "full disk"),
        "test_full_disk[import]": ("import", "full disk"),
        "test_full_disk[train]": ("train", "full disk"),
        "test_full_disk[mmd]": ("mmd", "full disk"),
        "test_full_disk[report]": ("report", "full disk"),
        "test_full_disk[plot]": ("plot", "full disk"),
        "test_full_disk[min-mass]": ("min-mass", "full disk"),
        "test_full_disk[export]": ("export", "full disk"),
        "test_full_disk[export-all]": ("export-all", "full disk"),
        "test_full_disk[study]": ("study", "full disk"),
        "test_full_disk_plot_temp_folder": ("plot", "full disk"),
        "test_full_disk_demo": ("demo", "full disk"),
        "test_full_disk_append_keeps_the_collection": ("import", "full disk"),
        "test_full_disk_reservation_is_given_back": ("import", "full disk"),
        "test_injected_hdf5_failure_new_collection": ("canonicalize", "full disk"),
        "test_injected_hdf5_failure_append": ("import", "full disk"),
        "test_real_hdf5_write_failure_does_not_crash": ("canonicalize", "full disk"),
        "test_injected_enospc_in_python_writes": ("min-mass", "full disk"),
        "test_injected_enospc_in_matplotlib": ("plot", "full disk"),
        "test_free_space_is_checked_before_any_work": ("canonicalize", "full disk"),
        "test_refused_reservation_leaves_the_collection_untouched": ("import", "full disk"),
    },
    "test_figure_outputs.py": {
        "test_plot_killed_between_a_figures_files_is_completed_by_the_rerun": (
            "plot", "multi-file outputs"),
        "test_plot_killed_before_publishing_leaves_no_figure": ("plot", "multi-file outputs"),
        "test_a_live_or_a_users_file_is_still_refused": ("plot", "multi-file outputs"),
        "test_atomic_files_publish_all_or_nothing": ("plot", "multi-file outputs"),
        "test_killed_plot_leaves_a_temp_folder_the_next_plot_reclaims": ("plot",
                                                                         "temp after kill"),
        "test_temporary_folder_is_locked_and_removed": ("plot", "temp after kill"),
    },
    "test_train_robustness.py": {
        "test_bad_spec_is_refused_before_anything_is_created": ("train", "bad spec"),
        "test_spec_path_that_is_no_file": ("train", "bad spec"),
        "test_bad_spec_in_a_real_process": ("train", "bad spec"),
        "test_a_spec_over_the_cap_is_refused_before_parsing": ("train", "spec size"),
        "test_train_option_values_are_checked_when_parsed": ("train", "bad option"),
        "test_failure_before_the_first_checkpoint_leaves_no_file": ("train", "all or nothing"),
        "test_missing_data_leaves_no_file": ("train", "all or nothing"),
        "test_second_train_is_busy_while_the_first_one_creates_the_file": ("train", "busy"),
        "test_second_train_is_busy_while_the_first_one_appends": ("train", "busy"),
        "test_killed_train_leaves_nothing_or_a_resumable_file": ("train", "sigkill"),
        "test_workers_end_when_the_train_process_is_killed": ("train", "orphans"),
    },
    "test_training_records.py": {
        "test_a_bad_record_is_refused_before_anything_is_written": ("train", "all or nothing"),
        "test_a_record_without_checkpoints_is_refused": ("train", "all or nothing"),
        "test_a_changed_record_is_refused_by_verify_and_by_verified_reads": ("verify",
                                                                              "content"),
        "test_a_record_that_is_not_json_is_refused_even_with_its_digest": ("verify",
                                                                            "content"),
        "test_a_crafted_record_table_is_refused_at_open": ("info", "structure"),
        "test_sigkill_between_the_record_and_the_commit_leaves_no_record": ("train",
                                                                             "sigkill"),
        "test_a_resumed_writer_records_the_killed_mode_again": ("train", "sigkill"),
        "test_records_of_an_uncommitted_block_are_dropped_by_the_next_writer": (
            "train", "all or nothing"),
    },
    "test_escaping.py": {
        "test_report_with_hostile_names": ("report", "escaping"),
        "test_plot_with_hostile_names": ("plot", "escaping"),
        "test_mmd_with_hostile_names": ("mmd", "escaping"),
    },
    "test_bundled_data.py": {
        "test_demo_writes_the_report_with_no_data_anywhere": ("demo", "no system data"),
    },
    "test_terminal_output.py": {
        "test_verify_on_a_pipe_prints_no_progress_bar": ("verify", "not a terminal"),
        "test_a_failing_import_on_a_pipe_is_one_line": ("import", "not a terminal"),
    },
    "test_method_laplace.py": {
        "test_train_names_the_mode_whose_base_network_diverged": ("train", "method numerics"),
        "test_train_names_a_prior_too_small_and_the_suggestion_trains": ("train",
                                                                         "method numerics"),
        "test_train_refuses_a_prior_precision_out_of_range_when_the_spec_is_read": (
            "train", "bad option"),
    },
    "test_model_plugins.py": {
        "test_info_names_the_module_of_a_missing_model": ("info", "plugin model missing"),
        "test_an_entry_point_collection_names_the_package": ("info", "plugin model missing"),
        "test_a_collection_without_the_attribute_hints_at_models": ("info",
                                                                    "plugin model missing"),
        "test_a_crafted_model_module_attribute_is_refused": ("info", "plugin model missing"),
        "test_cli_models_option_and_environment": ("info", "plugin model missing"),
        "test_a_module_that_cannot_be_imported_is_one_line": ("info", "plugin model missing"),
        "test_train_in_worker_processes": ("train", "plugin model"),
        "test_a_worker_finds_the_module_where_its_parent_did": ("train", "plugin model"),
        "test_the_ray_backend_passes_the_plugins": ("train", "plugin model"),
        "test_the_spec_needs_the_model_and_mc_dropout_its_option": ("train", "plugin model"),
        "test_the_fast_engine_leaves_a_model_of_your_own_to_torch": ("train", "plugin model"),
        "test_a_factory_that_fails_is_one_line_before_any_worker": ("train", "plugin"),
        "test_resuming_with_a_factory_that_fails_is_one_line_before_any_worker": ("train",
                                                                                  "plugin"),
        "test_register_refuses_a_bad_input_shape_or_num_classes": ("register", "plugin"),
        "test_a_plugin_declaring_a_bad_input_shape_is_one_line_before_training": ("train",
                                                                                  "plugin"),
        "test_an_input_shape_function_giving_no_shape_names_the_model": ("input_shape",
                                                                         "plugin"),
    },
    "test_same_stem.py": {
        "test_compare_files_with_the_same_stem": ("compare", "same stem"),
        "test_canonical_copy_names_are_unique_and_safe": ("compare", "same stem"),
        "test_report_with_methods_of_the_same_stem": ("report", "same stem"),
        "test_plot_mmd_with_the_same_stem_uses_the_canonical_target": ("plot", "same stem"),
    },
    "test_dry_run.py": {
        "test_dry_run_prints_the_resolved_spec_and_writes_nothing": ("train", "dry run"),
        "test_dry_run_json_extrapolates_the_measured_steps": ("train", "dry run"),
        "test_dry_run_without_an_estimate_needs_no_data": ("train", "dry run"),
        "test_dry_run_says_when_the_data_are_not_here": ("train", "dry run"),
        "test_dry_run_refuses_what_train_refuses": ("train", "dry run"),
        "test_train_needs_an_output_or_a_dry_run": ("train", "dry run"),
        "test_an_unknown_method_in_the_listing_is_one_line": ("train", "dry run"),
    },
    "test_option_ranges.py": {     # its generated tests log each case themselves
        "test_every_beyond_one_epoch_is_refused_before_training": ("study", "bad option"),
        "test_toy_networks_times_points_and_norm_are_bounded": ("study", "bad option"),
    },
    "test_overhead.py": {
        "test_bad_options_are_one_line": ("overhead", "bad option"),
    },
    "test_canonicalize_collection.py": {
        "test_finite_weights_that_overflow_when_canonicalized_are_one_true_line": (
            "canonicalize", "content"),
        "test_api_overflow_error_names_the_python_argument": ("canonicalize", "content"),
        "test_canonicalize_refuses_an_existing_folder_before_any_work": ("canonicalize",
                                                                         "output policy"),
        "test_min_mass_refuses_an_existing_file_as_its_folder_before_any_work": (
            "min-mass", "output policy"),
    },
    "test_mmd_report.py": {
        "test_compare_refuses_a_missing_or_file_folder_before_any_work": ("compare",
                                                                          "bad option"),
    },
    "test_report.py": {
        "test_report_refuses_a_missing_workdir_before_any_work": ("report", "bad option"),
    },
    "test_diagnose.py": {
        "test_a_diverged_checkpoint_is_left_out_and_counted": ("diagnose", "diverged rows"),
        "test_a_chain_with_a_diverged_draw_gets_no_chain_statistics": ("diagnose",
                                                                       "diverged rows"),
    },
    "test_foreign_dtypes.py": {
        "test_big_endian_tensor_is_one_line[info]": ("info", "foreign dtype"),
        "test_big_endian_tensor_is_one_line[verify]": ("verify", "foreign dtype"),
        "test_big_endian_tensor_is_one_line[upload]": ("upload", "foreign dtype"),
        "test_a_big_endian_template_creates_nothing": ("create_zoo", "foreign dtype"),
        "test_num_classes_out_of_range_is_one_line": ("info", "foreign dtype"),
        "test_non_floating_weights_are_refused": ("canonicalize", "foreign dtype"),
        "test_import_refuses_non_floating_weights": ("import", "foreign dtype"),
        "test_unvalidated_wrong_shape_is_reported_by_info_and_verify": ("verify",
                                                                        "foreign dtype"),
        "test_commands_that_build_the_network_refuse_a_wrong_shape": ("min-mass",
                                                                      "foreign dtype"),
        "test_export_of_non_utf8_metadata_is_one_line": ("export", "foreign dtype"),
        "test_export_from_a_file_name_that_is_not_utf8": ("export", "foreign dtype"),
        "test_info_json_is_strict_with_a_nan_recipe": ("info", "foreign dtype"),
    },
    "test_byov.py": {
        "test_cli_bad_options_are_one_line": ("study", "bad option"),
        "test_cli_refuses_an_existing_output": ("study", "output policy"),
    },
}


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("POSTERIORZOO_PROBE_LOG")
    if not path or report.when != "call" or report.skipped:  # skipped: not tried
        return
    module, _, name = report.nodeid.partition("::")
    probes = PROBES.get(os.path.basename(module), {})
    probe = probes.get(name) or probes.get(name.split("[")[0])
    if probe is None:
        return
    with open(path, "a") as log:
        log.write(json.dumps({"suite": "marked", "command": probe[0], "class": probe[1],
                              "refused": True, "ok": report.passed}) + "\n")


STUDY_MODULE = "posteriorzoo.cli.study_command"


@pytest.fixture()
def study_cli(monkeypatch):
    """The CLI's ``main`` with the study command registered (the studies' tests)."""
    import posteriorzoo.cli
    from posteriorzoo.cli import main

    modules = posteriorzoo.cli._SUBCOMMAND_MODULES
    if STUDY_MODULE not in modules:
        monkeypatch.setattr(posteriorzoo.cli, "_SUBCOMMAND_MODULES", (*modules, STUDY_MODULE))
    return main


@pytest.fixture(scope="session", autouse=True)
def private_distance_cache(tmp_path_factory):
    """The distance cache in a folder of this test session's (posteriorzoo.mmd.cache): the
    tests neither fill the user's cache (up to 4 GB) nor depend on what earlier runs left
    there. A test that sets POSTERIORZOO_DISTANCE_CACHE itself (monkeypatch) wins; child
    processes inherit the folder."""
    variable = "POSTERIORZOO_DISTANCE_CACHE"
    before = os.environ.get(variable)
    os.environ[variable] = str(tmp_path_factory.mktemp("distance-cache"))
    yield
    if before is None:
        os.environ.pop(variable, None)
    else:
        os.environ[variable] = before
