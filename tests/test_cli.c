/*
 * test_cli.c — the number parsers every command line and text field goes
 * through (cf_parse_int, cf_parse_float in src/base/common.c; cf_parse_count
 * and the option table of cf_cli_parse in src/cmd/cli.c): the whole string
 * must be the number, one line names the option and the value.
 */
#include "test.h"
#include "base/common.h"
#include "cmd/cli.h"

#include <string.h>

static int err_has(const char *s) { return strstr(cf_last_error(), s) != NULL; }
static int err_one_line(void) { return strchr(cf_last_error(), '\n') == NULL; }

TEST(integers_are_the_whole_string_without_white_space_at_either_end) {
    long v = -1;
    CHECK(cf_parse_int("5", 0, 10, "--steps", &v) == 0 && v == 5);
    CHECK(cf_parse_int("-3", -5, 10, "--x", &v) == 0 && v == -3);
    /* strtol skips leading white space: " 5" read as 5 */
    const char *bad[] = {" 5", "5 ", "\t5", "5\n", "\n5", " ", "5 5", "5x", "0x10", "1e3", "5.0", "\v5", "5\r"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        v = 77;
        CHECK_MSG(cf_parse_int(bad[i], 0, 1000, "--steps", &v) == -1 && v == 77, "'%s' was accepted", bad[i]);
        CHECK_MSG(err_has("--steps: '") && err_has("' is not an integer") && err_one_line(), "%s", cf_last_error());
    }
    /* the value is shown as given, control bytes as '?' */
    CHECK(cf_parse_int(" 5", 0, 10, "--steps", &v) == -1 && err_has("--steps: ' 5' is not an integer"));
    CHECK(cf_parse_int("5\n", 0, 10, "--steps", &v) == -1 && err_has("--steps: '5?' is not an integer"));
    CHECK(cf_parse_int("", 0, 10, "--steps", &v) == -1 && err_has("empty value"));
    CHECK(cf_parse_int("11", 0, 10, "--steps", &v) == -1 && err_has("11 is outside [0, 10]"));
}

TEST(floats_are_the_whole_string_without_white_space_at_either_end) {
    double d = -1;
    CHECK(cf_parse_float("0.5", 0, 1, "--keep", &d) == 0 && d == 0.5);
    CHECK(cf_parse_float("1e-3", 0, 1, "--lr", &d) == 0 && d == 1e-3);
    const char *bad[] = {" 0.5", "0.5 ", "\t1e-3", "1e-3\n", "half", "nan", "inf", "0.5x", "0x1p-3", "0X.8"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        d = 77;
        CHECK_MSG(cf_parse_float(bad[i], 0, 1, "--keep", &d) == -1 && d == 77, "'%s' was accepted", bad[i]);
        CHECK_MSG(err_has("--keep: '") && err_has("' is not a finite number") && err_one_line(), "%s",
                  cf_last_error());
    }
    CHECK(cf_parse_float(" 0.5", 0, 1, "--keep", &d) == -1 && err_has("--keep: ' 0.5' is not a finite number"));
}

TEST(counts_with_suffixes_refuse_white_space_too) {
    long v = -1;
    CHECK(cf_parse_count("50k", 0, 1L << 40, "--tokens", &v) == 0 && v == 50000);
    CHECK(cf_parse_count("7", 0, 1L << 40, "--tokens", &v) == 0 && v == 7);
    const char *bad[] = {" 50k", "50 k", "50k ", " 7", "7 ", "\n2M"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        v = 77;
        CHECK_MSG(cf_parse_count(bad[i], 0, 1L << 40, "--tokens", &v) == -1 && v == 77, "'%s' was accepted", bad[i]);
        CHECK_MSG(err_has("--tokens: '") && err_one_line(), "%s", cf_last_error());
    }
}

TEST(the_option_table_refuses_white_space_around_numbers) {
    long steps = 0, tokens = 0;
    double lr = 0;
    cf_opt opts[] = {
        {"--steps", CF_OPT_INT, &steps, 1, 1000, "steps", 0},
        {"--tokens", CF_OPT_COUNT, &tokens, 1, 1e12, "tokens", 0},
        {"--lr", CF_OPT_FLOAT, &lr, 0, 10, "lr", 0},
    };
    char *ok[] = {"x", "--steps", "5", "--tokens=2k", "--lr", "0.1"};
    CHECK(cf_cli_parse("x", "", opts, 3, 6, ok) == 0 && steps == 5 && tokens == 2000 && lr == 0.1);
    const char *cases[][2] = {{"--steps", " 5"}, {"--steps", "5 "}, {"--tokens", " 2k"}, {"--lr", " 0.1"}};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        for (int k = 0; k < 3; k++) opts[k].seen = 0;
        char *argv[] = {"x", (char *)cases[i][0], (char *)cases[i][1]};
        CHECK_MSG(cf_cli_parse("x", "", opts, 3, 3, argv) == -1 && err_has(cases[i][0]) && err_has("' is not"),
                  "%s '%s': %s", cases[i][0], cases[i][1], cf_last_error());
    }
}

/* Every error is one line: the user's text it quotes (an unknown option, an
 * argument, a value) has its control bytes shown as '?', and UTF-8 is kept. */
TEST(errors_quoting_the_users_text_stay_one_line) {
    long steps = 0;
    cf_opt opts[] = {{"--steps", CF_OPT_INT, &steps, 1, 1000, "steps", 0}};
    char *bad_opt[] = {"x", "--st\neps", "5"};
    CHECK(cf_cli_parse("x", "", opts, 1, 3, bad_opt) == -1 && err_one_line() && err_has("--st?eps"));
    char *bad_arg[] = {"x", "da\rta\033[31m"};
    CHECK(cf_cli_parse("x", "", opts, 1, 2, bad_arg) == -1 && err_one_line() && !strchr(cf_last_error(), '\r') &&
          !strchr(cf_last_error(), '\033') && err_has("da?ta?[31m"));
    cf_fail("file '%s' %s", "caf\xc3\xa9\tx\n", "\x7f");
    CHECK_MSG(strcmp(cf_last_error(), "file 'caf\xc3\xa9?x?' ?") == 0, "%s", cf_last_error());
}

int main(void) {
    RUN(integers_are_the_whole_string_without_white_space_at_either_end);
    RUN(floats_are_the_whole_string_without_white_space_at_either_end);
    RUN(counts_with_suffixes_refuse_white_space_too);
    RUN(the_option_table_refuses_white_space_around_numbers);
    RUN(errors_quoting_the_users_text_stay_one_line);
    return test_summary();
}
