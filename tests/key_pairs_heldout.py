"""Labelled key pairs held out from tuning (True: the same fact about the user).

Written for other concepts than the calibration set (``tests/key_pairs.py``), the
drifting model's key families and the concept lexicon: pets, health, travel, finance,
family, devices and the like. Nothing in the matcher was tuned on these pairs; they say
how it does on keys it was not built around.
"""

from __future__ import annotations

SAME: tuple[tuple[str, str], ...] = (
    # pets
    ("pet_type", "kind_of_pet"),
    ("dog_breed", "breed_of_dog"),
    ("vet_name", "veterinarian_name"),
    ("number_of_pets", "pet_count"),
    ("cat_age", "age_of_cat"),
    # health
    ("blood_type", "blood_group"),
    ("food_allergies", "food_allergy"),
    ("medications", "medication_list"),
    ("doctor_name", "physician_name"),
    ("family_doctor", "general_practitioner"),
    ("exercise_routine", "workout_routine"),
    ("body_weight", "weight"),
    # travel
    ("passport_number", "passport_no"),
    ("frequent_flyer_number", "airline_loyalty_number"),
    ("preferred_airline", "favorite_airline"),
    ("seat_preference", "preferred_seat"),
    ("dream_destination", "dream_vacation_spot"),
    ("hotel_preference", "preferred_hotel"),
    # finance
    ("bank", "bank_name"),
    ("monthly_budget", "budget_per_month"),
    ("income", "salary"),
    ("currency", "preferred_currency"),
    ("savings_goal", "saving_target"),
    # family
    ("children_names", "kids_names"),
    ("number_of_children", "how_many_kids"),
    ("husband_name", "name_of_husband"),
    ("mother_maiden_name", "mothers_maiden_name"),
    ("siblings", "brothers_and_sisters"),
    ("grandma_name", "grandmother_name"),
    # devices
    ("phone_model", "smartphone_model"),
    ("laptop_model", "notebook_model"),
    ("wifi_password", "wireless_password"),
    ("smart_speaker", "voice_assistant_device"),
    # the rest
    ("native_tongue", "mother_tongue"),
    ("car_make", "car_brand"),
    ("license_plate", "number_plate"),
    ("wake_up_time", "waking_time"),
    ("favorite_band", "favourite_music_group"),
    ("hair_colour", "hair_color"),
    ("shoe_size", "ShoeSize"),
)

DIFFERENT: tuple[tuple[str, str], ...] = (
    # pets
    ("dog_breed", "cat_breed"),
    ("dog_food_brand", "cat_food_brand"),
    ("puppy_name", "kitten_name"),
    ("vet_name", "vet_phone"),
    # health
    ("blood_pressure", "blood_type"),
    ("food_allergy", "drug_allergy"),
    ("systolic_pressure", "diastolic_pressure"),
    ("resting_heart_rate", "max_heart_rate"),
    ("dentist_name", "doctor_name"),
    ("left_eye_prescription", "right_eye_prescription"),
    # travel
    ("departure_airport", "arrival_airport"),
    ("outbound_flight", "return_flight"),
    ("check_in_date", "check_out_date"),
    ("passport_number", "passport_expiry"),
    ("favorite_country", "least_favorite_country"),
    ("summer_vacation_spot", "winter_vacation_spot"),
    # finance
    ("checking_account", "savings_account"),
    ("monthly_income", "monthly_expenses"),
    ("credit_card_limit", "credit_score"),
    ("gross_salary", "net_salary"),
    ("bank_name", "bank_account_number"),
    # family
    ("husband_name", "wife_name"),
    ("son_birthday", "daughter_birthday"),
    ("older_brother", "younger_brother"),
    ("mother_in_law_name", "mother_name"),
    ("niece_name", "nephew_name"),
    ("grandmother_name", "grandfather_name"),
    # devices
    ("phone_model", "laptop_model"),
    ("wifi_name", "wifi_password"),
    ("ios_version", "android_version"),
    ("work_laptop", "personal_laptop"),
    ("tablet_brand", "phone_brand"),
    # the rest
    ("city_of_birth", "city_of_residence"),
    ("wake_up_time", "bed_time"),
    ("shirt_size", "shoe_size"),
    ("office_phone", "home_phone"),
)
