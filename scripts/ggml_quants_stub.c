// The four ggml.c symbols ggml-quants.c calls, for scripts/make_imatrix_quant_fixtures.py.
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
// the few ggml.c symbols ggml-quants.c calls (row sizes of the types the tests quantize)
static const int BLCK[40] = {[2]=32,[3]=32,[6]=32,[7]=32,[8]=32,[10]=256,[11]=256,[12]=256,[13]=256,[14]=256,[20]=32};
static const int TSZ[40]  = {[2]=18,[3]=20,[6]=22,[7]=24,[8]=34,[10]=84,[11]=110,[12]=144,[13]=176,[14]=210,[20]=18};
size_t ggml_row_size(int type, int64_t ne) { return (size_t)(TSZ[type] * (ne / BLCK[type])); }
size_t ggml_type_size(int type) { return TSZ[type]; }
const char * ggml_type_name(int type) { (void)type; return "?"; }
void ggml_abort(const char * file, int line, const char * fmt, ...) { fprintf(stderr, "abort %s:%d %s\n", file, line, fmt); abort(); }
