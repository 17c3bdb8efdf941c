/* commands.h — the subcommands of the `centrifuge` binary (argv[0] is the
 * subcommand name). Each returns the process exit code: 0 ok, 1 runtime
 * error, 2 usage error. */
#ifndef CF_COMMANDS_H
#define CF_COMMANDS_H
int cmd_train(int argc, char **argv);
int cmd_eval(int argc, char **argv);
int cmd_score(int argc, char **argv);
int cmd_bench(int argc, char **argv);
int cmd_generate(int argc, char **argv);
int cmd_demo(int argc, char **argv);
int cmd_gen_data(int argc, char **argv);
int cmd_math_eval(int argc, char **argv);
int cmd_convert(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
#endif
