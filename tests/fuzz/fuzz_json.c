/*
 * fuzz_json.c — libFuzzer target for the JSON reader behind checkpoint indexes
 * (fsdp_io_json_parse, src/io/json.c). A rejected document must have a message
 * naming the file; an accepted one must print (cJSON_Print) to text that parses again. The
 * index's own schema checks (fsdp layer) can be added here when they exist.
 * Built and run by tests/recipes/fuzz_io.sh.
 */
#include <cjson/cJSON.h>
#include <stdint.h>
#include <string.h>

#include "io/io.h"

#define NAME "fuzz.json"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  cJSON *doc = NULL;
  if (fsdp_io_json_parse(&doc, NAME, (const char *)data, size) != FSDP_OK) {
    if (doc != NULL || strncmp(fsdp_error_msg(), NAME ": ", strlen(NAME) + 2) != 0)
      __builtin_trap();
    return 0;
  }
  char *text = cJSON_PrintUnformatted(doc);
  if (text != NULL) {
    cJSON *again = NULL;
    if (fsdp_io_json_parse(&again, NAME, text, strlen(text)) != FSDP_OK) __builtin_trap();
    cJSON_Delete(again);
    cJSON_free(text);
  }
  cJSON_Delete(doc);
  return 0;
}
